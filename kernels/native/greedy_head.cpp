// The greedy next token of a few rows, without reading the whole output head: each row's argmax of x @ head.T, the
// same token (bit for bit the same logits compared) as the full head's linear (linear.cpp) and argmax.cpp give.
//
// Why: a single-stream fp32 decode step of SmolLM2 reads its 113 MB tied head every step, ~a fifth of the step's
// weights, to take one argmax. A copy of the head in int8 (a scale a vocabulary row, 28 MB) screens the vocabulary:
// each row's approximate logit a_n = scale_n * t * (codes_n . p), x ~ t * p in integers, differs from the exact
// one by at most radius_n * |x|_1 (the row's largest quantisation error plus what fp32 rounding can add to the exact
// sum, kernels/native.py's head_screen()) + scale_n * 127 * in_features * t / 2 (the input's rounding). A vocabulary
// row whose upper bound falls below some row's lower bound cannot be the argmax; the few that remain (a handful of
// SmolLM2's 49,152) are computed exactly, by the head's own linear over those blocks of 32 rows. The linear's
// arithmetic for a block depends only on the call's rows and inputs, not on how many blocks the call has, so each
// candidate's logit is the one the full call computes (given all the step's rows, as the full head is), and the
// first largest among them (candidates in ascending order; every other row strictly below) is torch.argmax's answer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "c_api.h"
#include "common.h"

namespace {

constexpr int kBlockVecs = kBlockCols / kLanes;  // the codes are blocked as the linear's weights (c_api.h)
// Sums a screening pass keeps in registers beside a step's codes and an input: 28 on AVX-512 (a row's sums are 2
// vectors), 10 on AVX2 (4 vectors a row).
constexpr int kSumRegisters = kVecRegisters - kBlockVecs - 2;
constexpr int kPassRows = std::min(8, std::max(1, kSumRegisters / kBlockVecs));  // 8 on AVX-512, 2 on AVX2
// Sets of sums taking alternate steps, so that few rows still have enough independent sums in flight.
template <int rows>
constexpr int kUnroll = std::clamp(kSumRegisters / (kBlockVecs * rows), 1, 4);
// Rows a call screens at most: past about this many the full head's multiply-adds, not its reads, bound its time.
constexpr int64_t kMaxScreenedRows = 16;
// The most of the head's blocks a call computes exactly: a quarter, which with the screen (a quarter of the fp32 head's
// bytes) is about what the full head costs; more, and the caller computes the full head. SmolLM2's fp32 steps have
// had a handful of candidates a row (median 5, 90th percentile 23, at most 80 of 49,152), and 16-row steps up to 173
// of its 1,536 blocks: with at most 64 most of those steps had been declined, after screening.
constexpr int64_t kHeadBlocksPerExactBlock = 4;

// The screen's products are integers: the codes (int8) times each row's input as int16, x_k ~ t * p_k with
// |p_k| <= the largest that keeps a sum of in_features products within int32, pairs of them a 32-bit lane's dot
// product (AVX-512 VNNI's vpdpwssd, or vpmaddwd and an add): one and a half vector instructions per 16 codes. With
// the codes widened to floats and fp32 multiply-adds (three) a one-row screen of SmolLM2's head took 1.5-1.6 ms
// with the codes from DRAM and 1.1 ms from L3; this 1.2 and 0.9 ms (the full fp32 head 3.7-4.0 and 2.3-2.5).

// A step's 2 inputs x 32 features of codes ([pair][32][2] int8) as a block's kBlockVecs vectors of int16 pairs.
inline void widen_codes(const int8_t *step, IntVec (&w)[kBlockVecs]) {
    for (int v = 0; v < kBlockVecs; v++) {
        const int8_t *from = step + v * 2 * kLanes;
#if PARROT_LANES == 16 && defined(__AVX512BW__)
        w[v] = (IntVec)_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(from)));
#elif PARROT_LANES == 8 && defined(__AVX2__)
        w[v] = (IntVec)_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(from)));
#else
        int16_t pairs[2 * kLanes];
        for (int i = 0; i < 2 * kLanes; i++) pairs[i] = from[i];
        std::memcpy(&w[v], pairs, sizeof pairs);
#endif
    }
}

// sum += the lanes' pair products of codes (int16 pairs) and input (one int16 pair in every lane).
inline void dot_pairs(IntVec &sum, IntVec codes, IntVec input) {
#if PARROT_LANES == 16 && defined(__AVX512VNNI__)
    sum = (IntVec)_mm512_dpwssd_epi32((__m512i)sum, (__m512i)codes, (__m512i)input);
#elif PARROT_LANES == 16 && defined(__AVX512BW__)
    sum += (IntVec)_mm512_madd_epi16((__m512i)codes, (__m512i)input);
#elif PARROT_LANES == 8 && defined(__AVX2__)
    sum += (IntVec)_mm256_madd_epi16((__m256i)codes, (__m256i)input);
#else
    int16_t c[2 * kLanes], x[2 * kLanes];
    std::memcpy(c, &codes, sizeof c);
    std::memcpy(x, &input, sizeof x);
    for (int l = 0; l < kLanes; l++) sum[l] += c[2 * l] * x[2 * l] + c[2 * l + 1] * x[2 * l + 1];
#endif
}

// Approximate logits of `rows` rows for one block of codes ([in_features / 2][32][2]): `inputs` holds each row's
// int16 pairs ([rows][in_features / 2] 32-bit words) and `units` the size of a row's integer unit, t. `unroll`
// sets of sums take alternate steps, so that one row still has enough independent sums in flight. The next
// block's codes are asked for meanwhile: a thread's blocks follow each other.
template <int rows, int unroll>
void screen_pass(const int8_t *codes, const int32_t *inputs, const float *units, int64_t pairs, const float *scales,
                 float *approx, int64_t vocab) {
    constexpr int64_t kStep = 2 * kBlockCols;  // bytes of codes a step
    IntVec sums[unroll][rows][kBlockVecs] = {};
    const auto add_step = [&](IntVec(&into)[rows][kBlockVecs], int64_t s) {
        IntVec w[kBlockVecs];
        widen_codes(codes + s * kStep, w);
        for (int r = 0; r < rows; r++) {
            const IntVec input = inputs[r * pairs + s] - IntVec{};
            for (int v = 0; v < kBlockVecs; v++) dot_pairs(into[r][v], w[v], input);
        }
    };
    const int8_t *next = codes + pairs * kStep;
    int64_t s = 0;
    for (; s + unroll <= pairs; s += unroll)
        for (int u = 0; u < unroll; u++) {
            __builtin_prefetch(next + (s + u) * kStep, 0, 2);
            add_step(sums[u], s + u);
        }
    for (; s < pairs; s++) add_step(sums[0], s);
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < kBlockVecs; v++) {
            IntVec sum = sums[0][r][v];
            for (int u = 1; u < unroll; u++) sum += sums[u][r][v];
            save(approx + r * vocab + v * kLanes, __builtin_convertvector(sum, Vec) * (load(scales + v * kLanes) * units[r]));
        }
}

using ScreenPass = void (*)(const int8_t *, const int32_t *, const float *, int64_t, const float *, float *, int64_t);

template <int... rows>
ScreenPass screen_pass_among(int64_t count, std::integer_sequence<int, rows...>) {
    ScreenPass chosen = nullptr;
    ((chosen = count == rows + 1 ? screen_pass<rows + 1, kUnroll<rows + 1>> : chosen), ...);
    return chosen;
}

// Every row's approximate logits, [rows][vocab], the blocks spread over the threads.
void screen(const int8_t *codes, const int32_t *inputs, const float *units, int64_t rows, int64_t pairs,
            const float *scales, float *approx, int64_t vocab, int num_threads) {
    const int64_t blocks = vocab / kBlockCols;
#pragma omp parallel for num_threads(std::max(num_threads, 1)) schedule(dynamic, 16)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t row = 0; row < rows; row += kPassRows) {
            const int64_t count = std::min<int64_t>(kPassRows, rows - row);
            screen_pass_among(count, std::make_integer_sequence<int, kPassRows>{})(
                codes + b * kBlockCols * 2 * pairs, inputs + row * pairs, units + row, pairs, scales + b * kBlockCols,
                approx + row * vocab + b * kBlockCols, vocab);
        }
}

// A row's bounds on its exact logits: approx -+ reach, reach = radius * |x|_1 (the codes' error, and the rounding
// of the exact sum) + scale * rounded (the input's rounding to integers) + slack, widened by `relative` of the
// bounds' magnitude (the rounding of these fp32 sums, and bf16's rounding of the exact logit), lane by lane.
struct Bounds {
    float l1, rounded, relative;
    Vec reach(Vec approx, Vec radius, Vec scale) const {
        const Vec far = radius * l1 + scale * rounded + 1e-30f;
        const Vec magnitude = approx < 0 ? -approx : approx;
        return far + (magnitude + far) * relative;
    }
};

// The vocabulary rows whose upper bound reaches the largest lower bound, ascending; false where a bound is not
// finite (the caller computes the full head then).
bool candidates_of(const float *approx, const float *radii, const float *scales, int64_t vocab, Bounds bounds,
                   std::vector<int32_t> &out) {
    Vec max_low = Vec{} - INFINITY, max_high = max_low;
    for (int64_t n = 0; n < vocab; n += kLanes) {
        const Vec a = load(approx + n), reach = bounds.reach(a, load(radii + n), load(scales + n));
        const Vec low = a - reach, high = a + reach;
        max_low = low > max_low ? low : max_low;
        max_high = high > max_high ? high : max_high;
        max_high = high != high ? Vec{} + INFINITY : max_high;  // a NaN
    }
    const float threshold = max_lanes(max_low);  // no row whose upper bound is below it can be the largest
    if (!std::isfinite(threshold) || !std::isfinite(max_lanes(max_high))) return false;
    for (int64_t n = 0; n < vocab; n += kLanes) {
        const Vec a = load(approx + n), high = a + bounds.reach(a, load(radii + n), load(scales + n));
        const auto reaches = high >= threshold;
        bool any = false;
        for (int l = 0; l < kLanes; l++) any |= reaches[l] != 0;
        if (!any) continue;
        for (int l = 0; l < kLanes; l++)
            if (reaches[l]) out.push_back(static_cast<int32_t>(n + l));
    }
    return true;
}

inline float as_float(float x) { return x; }
inline float as_float(uint16_t x) { return bf16_to_float(x); }

int linear_of(const float *x, const float *weight, float *out, int64_t rows, int64_t out_features, int64_t in_features) {
    return parrot_linear_f32(x, weight, nullptr, out, rows, out_features, in_features, 1);
}
int linear_of(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t out_features,
              int64_t in_features) {
    return parrot_linear_bf16(x, weight, nullptr, out, rows, out_features, in_features, 1);
}

// A row's input as int16 pairs for the screen, x_k ~ unit * p_k with |p_k| <= largest; its bounds' terms.
template <typename T>
Bounds integer_input(const T *x, int64_t in_features, int32_t largest, float output_rounding, int32_t *pairs,
                     float &unit) {
    double l1 = 0, top = 0;
    for (int64_t k = 0; k < in_features; k++) {
        const double value = as_float(x[k]);
        l1 += std::fabs(value);
        top = std::max(top, std::fabs(value));
    }
    if (!std::isfinite(l1)) return {NAN, NAN, NAN};  // before converting to integers what may be NaN or inf
    const double t = top > 0 ? top / largest : 1;
    for (int64_t k = 0; k < in_features; k += 2) {
        const auto p = [&](int64_t i) { return static_cast<uint16_t>(static_cast<int16_t>(std::nearbyint(as_float(x[i]) / t))); };
        pairs[k / 2] = static_cast<int32_t>(p(k) | static_cast<uint32_t>(p(k + 1)) << 16);
    }
    unit = static_cast<float>(t);
    // |x_k - t p_k| <= t / 2 (the division and rounding in double: 2^-20 more kept), times the largest code (127).
    const double rounded = 127 * in_features * (t / 2) * (1 + 0x1p-20);
    // |x|_1 rounded up; the bounds' own fp32 sums widened by 2^-20 of their magnitude.
    return {static_cast<float>(l1 * (1 + 0x1p-20)), static_cast<float>(rounded * (1 + 0x1p-20)),
            output_rounding + 0x1p-20f};
}

// The candidates' blocks of the head exactly, each as the full call computes it, [block][rows][32]: a block to a
// call (whose own team of one runs on the calling thread), spread over the threads. 0, or the linear's status.
template <typename T>
int exact_blocks(const T *x, int64_t rows, int64_t in_features, const T *packed_head, const std::vector<int32_t> &blocks,
                 T *exact, int num_threads) {
    int status = 0;
#pragma omp parallel for num_threads(std::max(num_threads, 1)) schedule(dynamic, 1) reduction(| : status)
    for (size_t j = 0; j < blocks.size(); j++)
        status |= linear_of(x, packed_head + blocks[j] * kBlockCols * in_features, exact + j * rows * kBlockCols, rows,
                            kBlockCols, in_features);
    return status;
}

// Row r's first largest exact logit among its candidates (ascending), -1 for a NaN among them (torch's argmax would
// pick it: the caller computes the full head).
template <typename T>
int64_t first_largest(const std::vector<int32_t> &candidates, const std::vector<int32_t> &blocks, const T *exact,
                      int64_t rows, int64_t r) {
    float best = -INFINITY;
    int64_t best_at = -1;
    for (int32_t n : candidates) {
        const size_t j = std::lower_bound(blocks.begin(), blocks.end(), n / kBlockCols) - blocks.begin();
        const float logit = as_float(exact[(j * rows + r) * kBlockCols + n % kBlockCols]);
        if (std::isnan(logit)) return -1;
        if (best_at < 0 || logit > best) best = logit, best_at = n;
    }
    return best_at;
}

// See the top of this file; `output_rounding`: 0 for fp32 logits, bf16's rounding of a logit for bf16 ones.
template <typename T>
int screened_argmax(const T *x, int64_t rows, int64_t in_features, const T *packed_head, const int8_t *codes,
                    const float *scales, const float *radii, int64_t vocab, int64_t *tokens, int num_threads,
                    float output_rounding) {
    // The input's integers: as large as int16 holds, and a sum of in_features products of them with codes (<= 127)
    // within int32.
    const int64_t largest = std::min<int64_t>(32767, INT32_MAX / (127 * std::max<int64_t>(in_features, 1)));
    if (rows < 1 || rows > kMaxScreenedRows || vocab % kBlockCols || in_features < 2 || in_features % 2 || largest < 255)
        return -1;
    const int64_t pairs = in_features / 2;
    std::vector<int32_t> inputs(rows * pairs);
    std::vector<float> units(rows);
    std::vector<Bounds> bounds(rows);
    for (int64_t r = 0; r < rows; r++) {
        bounds[r] = integer_input(x + r * in_features, in_features, static_cast<int32_t>(largest), output_rounding,
                                  inputs.data() + r * pairs, units[r]);
        if (!std::isfinite(bounds[r].l1) || !std::isfinite(bounds[r].rounded)) return 1;
    }
    // Kept for the calling thread's next calls: 196 KB a row for SmolLM2, which malloc maps and unmaps each time,
    // each call then faulting its pages in again (~5% of a one-row call). Every element is written by screen().
    static thread_local std::vector<float> approx;
    approx.resize(std::max<size_t>(approx.size(), rows * vocab));
    screen(codes, inputs.data(), units.data(), rows, pairs, scales, approx.data(), vocab, num_threads);
    std::vector<std::vector<int32_t>> candidates(rows);
    std::vector<int32_t> blocks;
    for (int64_t r = 0; r < rows; r++) {
        if (!candidates_of(approx.data() + r * vocab, radii, scales, vocab, bounds[r], candidates[r])) return 1;
        for (int32_t n : candidates[r]) blocks.push_back(n / kBlockCols);
    }
    std::sort(blocks.begin(), blocks.end());
    blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
    if (static_cast<int64_t>(blocks.size()) * kHeadBlocksPerExactBlock > vocab / kBlockCols) return 1;
    std::vector<T> exact(blocks.size() * rows * kBlockCols);
    if (int status = exact_blocks(x, rows, in_features, packed_head, blocks, exact.data(), num_threads)) return status;
    for (int64_t r = 0; r < rows; r++)
        if ((tokens[r] = first_largest(candidates[r], blocks, exact.data(), rows, r)) < 0) return 1;
    return 0;
}

}  // namespace

extern "C" {

int parrot_screened_argmax_f32(const float *x, int64_t rows, int64_t in_features, const float *packed_head,
                               const int8_t *codes, const float *scales, const float *radii, int64_t vocab,
                               int64_t *tokens, int num_threads) {
    return screened_argmax<float>(x, rows, in_features, packed_head, codes, scales, radii, vocab, tokens, num_threads, 0);
}

int parrot_screened_argmax_bf16(const uint16_t *x, int64_t rows, int64_t in_features, const uint16_t *packed_head,
                                const int8_t *codes, const float *scales, const float *radii, int64_t vocab,
                                int64_t *tokens, int num_threads) {
    // A bf16 logit is its fp32 sum rounded to nearest bf16 (8 significant bits): within 2^-8 of its magnitude.
    return screened_argmax<uint16_t>(x, rows, in_features, packed_head, codes, scales, radii, vocab, tokens,
                                     num_threads, 0x1p-8f);
}

}  // extern "C"
