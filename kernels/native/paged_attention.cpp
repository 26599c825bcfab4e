// Paged decode attention for CPU tensors: one query token per sequence over its cached context,
// optionally split into a prefix shared by a group of sequences and each one's own tokens.
//
// Built and loaded by kernels/native.py (the system C++ compiler, -O3 -march=native -fopenmp; no
// torch headers, so it builds in about a second), called through ctypes. Layouts as
// kernels/dispatch.py states them, all contiguous: q and out [B, H, D], caches [num_blocks,
// block_size, KVH, D], block tables int32 [rows, stride], lengths int32.
//
// Work is split into tasks of (kv head, tile of sequences): a tile is the members of one shared
// prefix (at most kTileRows query rows), or a single sequence with none. A task keeps an online
// softmax state per query row (running max, sum, fp32 accumulator); it reads each prefix token's key
// and value once for all the tile's rows, then each member's rows go on over that member's own
// tokens (a long prefix with too few tasks for the threads goes in two halves, two tasks whose states are
// merged after). Tokens go a segment of 256 at a time: all the segment's scores, then each row's softmax step,
// then the values. Keys are converted to fp32 a segment at a time, transposed, so the scores of a chunk
// are vector FMAs over its tokens; nothing is gathered into padded copies (the torch path's cost). bf16
// with 8 rows or more, or over a run of 32 tokens or more, scores and sums values with the CPU's bf16
// dot product instead (keys and values rearranged into pairs in registers), its softmax weights
// rounded to bf16 for the values' sums (as flash attention does), made by an exp accurate to bf16's needs.
// Where the CPU has AMX (common.h) and the head size is a multiple of 32, those pair layouts are the operands
// of tile multiply-adds instead: 16 query rows a tile (2.4-2.8x the dot-product path on a prefill here).
//
// A causal prefill is the same call (kernels/cpu_attention.py lays it out): its new tokens in tiles of
// 32 (kTileRows / 3 with SmolLM2's heads), a tile's "prefix" the whole blocks before its first token, each
// row's own tokens the rest up to itself (runs nested in one table, which the tile's rows take in one pass). The engine makes a step's
// decodes and prefill chunks one call (cpu_attention.join_rows); tasks run longest first.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <vector>

#include "c_api.h"
#include "common.h"

namespace {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kChunk = 32;  // tokens a block of scores covers (two AVX-512 vectors, four AVX2)
// Tokens whose scores are all made before any is exponentiated: the online softmax's max, rescale and sum
// then move once a segment instead of once a chunk (they were a fifth of a long prefill's attention).
constexpr int64_t kSegment = 256;
// A row of a segment's scores, weights or transposed keys: a segment and a vector, so that rows a whole 1 KB
// apart do not all fall in the same few L1 sets (fp32 attention ran 1.2-1.7x slower with rows 1 KB apart).
constexpr int64_t kStride = kSegment + kLanes;
// Query rows sharing one pass over a prefix: a 32-token prefill tile with SmolLM2's 3 query heads a kv head
// (kernels/cpu_attention.py lays prefill out so). At twice the 48 it was, a prefill converts (bf16) or transposes
// (fp32) each prefix's keys and values half as often. bf16, with score_segment_tiles and value_tiles_two_rows:
// a 1,000-token prefill's attention 0.85x the time, 256 tokens 0.86x, decodes 0.98-1.03x (benchmarks/kernel_revisions).
// fp32 had stayed at 48, its scratch sized for 96 rows then running its decodes 3-15% slower; since kStride's
// padding, 96 ran a 1,000-token fp32 prefill's attention at 0.87-0.94x the time and 256 tokens 0.92-0.95x, decodes
// 1.00x and 16 forks 0.93-1.00x (three A/Bs of 40 alternating rounds, the earlier revision planned in 48-row tiles;
// docs/benchmarks/kernel_revisions_fp32_tiles_96.json).
constexpr int64_t kTileRows = 96;  // also the bound of a task's per-row arrays

struct BFloat16 {
    uint16_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(BFloat16 x) { return bf16_to_float(x.bits); }

inline void store(float &to, float x) { to = x; }

inline void store(BFloat16 &to, float x) { to.bits = float_to_bf16(x); }

// exp for x <= 0 (scores minus their running max), lane by lane (exp_in_range, relative error ~1e-7).
inline Vec exp_nonpositive(Vec x) {
    return exp_in_range(x < -87.0f ? Vec{} - 87.0f : x);  // exp(-87) ~ 1.6e-38; a masked score is -inf, its weight ~0
}

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// The lanes of a vector whose index is below n (all for n >= kLanes, none for n <= 0).
inline IntVec lanes_below(int64_t n) {
    IntVec lane;
    for (int32_t i = 0; i < kLanes; i++) lane[i] = i;
    return lane < static_cast<int32_t>(std::clamp<int64_t>(n, 0, kLanes));
}

// The running max of a row moved on to its segment's (over its first `valid` scores, valid > 0, each times
// `scale` > 0); returns the factor the row's earlier sums are scaled by.
inline float move_max(const float *score, int64_t valid, float &running_max, float scale = 1.0f) {
    const int64_t last = (valid - 1) / kLanes * kLanes;  // the vector holding the last valid score
    Vec maxes = lanes_below(valid - last) ? load(score + last) : Vec{} - INFINITY;
    for (int64_t t = 0; t < last; t += kLanes) {
        const Vec x = load(score + t);
        maxes = x > maxes ? x : maxes;
    }
    const float segment_max = max_lanes(maxes) * scale;
    const float new_max = segment_max > running_max ? segment_max : running_max;
    const float rescale = exp_nonpositive(running_max - new_max);
    running_max = new_max;
    return rescale;
}

// One row's online softmax step over a segment's scores (`valid` of them its own; `padded`, the segment's
// tokens rounded up to whole chunks), in vectors: the running max and total move on, the weights (zeros
// past `valid`) are written, and the factor the row's earlier sums are scaled by is returned.
inline float softmax_step(const float *score, int64_t valid, int64_t padded, float &running_max, float &total,
                          float *weight) {
    if (valid <= 0) {  // a row whose run ended in an earlier segment (nested runs): its state stays as it is
        for (int64_t t = 0; t < padded; t += kLanes) save(weight + t, Vec{});
        return 1.0f;
    }
    const float rescale = move_max(score, valid, running_max);
    const int64_t last = (valid - 1) / kLanes * kLanes;
    Vec sums{};
    for (int64_t t = 0; t < last; t += kLanes) {
        const Vec w = exp_nonpositive(load(score + t) - running_max);
        save(weight + t, w);
        sums += w;
    }
    const Vec w = lanes_below(valid - last) ? exp_nonpositive(load(score + last) - running_max) : Vec{};
    save(weight + last, w);
    sums += w;
    for (int64_t t = last + kLanes; t < padded; t += kLanes) save(weight + t, Vec{});
    total = total * rescale + sum_lanes(sums);
    return rescale;
}

struct Shape {
    int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks;
    float scale;
    int64_t q_stride;  // elements from one token's queries to the next's (its heads are head_dim apart)
    int64_t group() const { return num_heads / num_kv_heads; }
};

// A run of cached tokens: the first `length` of a block table's row.
struct Tokens {
    const int32_t *table;
    int64_t length;
};

// Where kv head `kv_head` of a cache slot's key (or value) row is.
template <int64_t DIM, typename T>
inline const T *cache_row(const T *cache, int64_t slot, int64_t kv_head, const Shape &shape) {
    return cache + (slot * shape.num_kv_heads + kv_head) * DIM;
}

constexpr int64_t kChunkVecs = kChunk / kLanes;

// Per task: the online softmax state of up to kTileRows query rows; a segment's scores and weights
// ([rows][kStride]); its keys transposed ([dim][kStride]), and bf16 keys and values converted to fp32 rows
// ([kSegment][dim], pointed to by key_rows and value_rows; fp32 caches' rows are read where they are).
// Rows past a call's last that a tile pass may read and write (scores, weights, queries: the tile's 16 rows
// padded; those rows' results are dropped, and each row's products depend on its own inputs alone).
constexpr int64_t kTilePadRows = 16;

struct Scratch {
    std::vector<float> queries, acc, running_max, total, scores, weights, keys_t, keys, values;
    // bf16 segments' rows of keys and values, one pointer a token (fp32_rows).
    const float *key_rows[kSegment], *value_rows[kSegment];
    // bf16 pairs (the bf16 dot-product path): queries [rows][dim/2], keys [dim/2][kStride], values
    // [kSegment/2][dim] (tokens 2t and 2t+1 of one dimension), weights [rows][kStride/2].
    std::vector<uint32_t> query_pairs, key_pairs, value_pairs, weight_pairs;
    bool tiles = false;  // the pairs' products on AMX tiles (run_tasks configured this thread's)
    Scratch(int64_t dim, int64_t rows)
        : queries(rows * dim), acc(rows * dim), running_max(rows), total(rows),
          scores((rows + kTilePadRows) * kStride), weights(rows * kStride), keys_t(dim * kStride),
          keys(kSegment * dim), values(kSegment * dim), query_pairs((rows + kTilePadRows) * dim / 2),
          key_pairs(dim / 2 * kStride), value_pairs(kSegment / 2 * dim),
          weight_pairs((rows + kTilePadRows) * kStride / 2) {}
};

// Score sums kept in registers, half of them (common.h's kVecRegisters), beside a chunk's keys and a broadcast
// query value: 8 rows' on AVX-512, 2 rows' on AVX2, where more rows are scored a group at a time.
constexpr int64_t kScoreSumVecs = kVecRegisters / 2;

template <int64_t ROWS, int64_t DIM>
inline void score_group(const float *__restrict queries, const float *__restrict keys_t, float *__restrict scores);

// Scores of ROWS query rows against a chunk's keys (keys_t: the chunk's column of [DIM][kStride]; scores:
// rows of kStride), the accumulators kept in registers, a group of rows at a time.
template <int64_t ROWS, int64_t DIM>
inline void score_rows(const float *__restrict queries, const float *__restrict keys_t, float *__restrict scores) {
    constexpr int64_t kGroup = kScoreSumVecs / kChunkVecs;
    if constexpr (ROWS > kGroup) {
        score_rows<kGroup, DIM>(queries, keys_t, scores);
        score_rows<ROWS - kGroup, DIM>(queries + kGroup * DIM, keys_t, scores + kGroup * kStride);
    } else {
        score_group<ROWS, DIM>(queries, keys_t, scores);
    }
}

// score_rows for rows whose sums fit the registers together. Rows whose two sets of sums fit too (fewer than 4
// on AVX-512, 1 on AVX2) split the head dimension over two sets: independent FMAs overlap, where one chain
// would wait on each FMA's latency.
template <int64_t ROWS, int64_t DIM>
inline void score_group(const float *__restrict queries, const float *__restrict keys_t, float *__restrict scores) {
    constexpr int64_t kSets = ROWS < 4 && 2 * ROWS * kChunkVecs <= kScoreSumVecs ? 2 : 1;
    Vec sums[kSets][ROWS][kChunkVecs] = {};
    for (int64_t d = 0; d < DIM; d += kSets) {
        for (int64_t set = 0; set < kSets; set++) {
            Vec keys[kChunkVecs];
            for (int64_t c = 0; c < kChunkVecs; c++) keys[c] = load(keys_t + (d + set) * kStride + c * kLanes);
            for (int64_t r = 0; r < ROWS; r++) {
                const float q = queries[r * DIM + d + set];
                for (int64_t c = 0; c < kChunkVecs; c++) sums[set][r][c] += q * keys[c];
            }
        }
    }
    for (int64_t r = 0; r < ROWS; r++)
        for (int64_t c = 0; c < kChunkVecs; c++) {
            Vec total = sums[0][r][c];
            for (int64_t set = 1; set < kSets; set++) total += sums[set][r][c];
            save(scores + r * kStride + c * kLanes, total);
        }
}

// The same scores for a few rows, from a chunk's n key rows: a dot product per (row, token), each ending in a
// sum across lanes. Cheaper than transposing the keys when few rows read them.
template <int64_t ROWS, int64_t DIM>
inline void dot_rows(const float *__restrict queries, const float *const *keys, int64_t n, float *__restrict scores) {
    constexpr int64_t kVecs = DIM / kLanes;
    Vec query[ROWS][kVecs];
    for (int64_t r = 0; r < ROWS; r++)
        for (int64_t v = 0; v < kVecs; v++) query[r][v] = load(queries + r * DIM + v * kLanes);
    for (int64_t t = 0; t < n; t++) {
        Vec key[kVecs];
        for (int64_t v = 0; v < kVecs; v++) key[v] = load(keys[t] + v * kLanes);
        for (int64_t r = 0; r < ROWS; r++) {
            Vec products = query[r][0] * key[0];
            for (int64_t v = 1; v < kVecs; v++) products += query[r][v] * key[v];
            scores[r * kStride + t] = sum_lanes(products);
        }
    }
}

// Value sums kept in registers where a row's whole head does not fit, half of them, beside a token's values: 4
// rows x 64 dimensions on AVX-512, 4 rows x 16 on AVX2, where the head's dimensions go a slice at a time.
constexpr int64_t kValueSumVecs = kVecRegisters / 2;

// The largest divisor of n that is at most `bound` (1 if none is).
constexpr int64_t largest_divisor_at_most(int64_t n, int64_t bound) {
    for (int64_t d = std::min(n, bound); d > 1; d--)
        if (n % d == 0) return d;
    return 1;
}

// acc[r] = acc[r] * rescale[r] + sum over n tokens of weight[r][t] * values[t], for ROWS rows (rescale null: by 1).
template <int64_t ROWS, int64_t DIM>
inline void accumulate_rows(float *__restrict acc, const float *__restrict rescale, const float *__restrict weights,
                            const float *const *values, int64_t n) {
    constexpr int64_t kVecs = DIM / kLanes;  // whole rows where their sums and a token's values fit the registers
    constexpr int64_t kSliceVecs = (ROWS + 1) * kVecs <= kVecRegisters - 2
                                       ? kVecs : largest_divisor_at_most(kVecs, kValueSumVecs / ROWS);
    for (int64_t slice = 0; slice < DIM; slice += kSliceVecs * kLanes) {
        Vec sums[ROWS][kSliceVecs];
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t v = 0; v < kSliceVecs; v++) {
                const Vec sum = load(acc + r * DIM + slice + v * kLanes);
                sums[r][v] = rescale ? sum * rescale[r] : sum;
            }
        for (int64_t t = 0; t < n; t++) {
            Vec value[kSliceVecs];
            for (int64_t v = 0; v < kSliceVecs; v++) value[v] = load(values[t] + slice + v * kLanes);
            for (int64_t r = 0; r < ROWS; r++) {
                const float w = weights[r * kStride + t];
                for (int64_t v = 0; v < kSliceVecs; v++) sums[r][v] += w * value[v];
            }
        }
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t v = 0; v < kSliceVecs; v++) save(acc + r * DIM + slice + v * kLanes, sums[r][v]);
    }
}

#if defined(__AVX512F__)
// Key row r's dimensions [d, d + 16) as 16 fp32 lanes.
inline __m512i key_lanes(const float *row, int64_t d) { return _mm512_loadu_si512(row + d); }
inline __m512i key_lanes(const BFloat16 *row, int64_t d) {  // bf16 -> fp32: the 16 bits into the high half
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(row + d))), 16);
}

typedef __m512i KeyLanes;
inline void store_lanes(float *to, __m512i x) { _mm512_storeu_si512(to, x); }
#elif defined(__AVX2__)
inline __m256 key_lanes(const float *row, int64_t d) { return _mm256_loadu_ps(row + d); }
inline __m256 key_lanes(const BFloat16 *row, int64_t d) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i *>(row + d));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

typedef __m256 KeyLanes;
inline void store_lanes(float *to, __m256 x) { _mm256_storeu_ps(to, x); }
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// A segment's keys as fp32 columns, [DIM][kStride] (token t's dimension d at d * kStride + t; zeros past n tokens
// to `padded`, a whole number of chunks), transposed kLanes tokens x kLanes dimensions at a time in registers.
// Copied one element at a time they had been a fifth of an fp32 prefill's attention (perf).
template <int64_t DIM, typename T>
inline void keys_to_columns(const T *const *keys, int64_t n, int64_t padded, float *keys_t) {
    static_assert(DIM % kLanes == 0, "whole columns of lanes");
    for (int64_t token0 = 0; token0 < padded; token0 += kLanes)
        for (int64_t d0 = 0; d0 < DIM; d0 += kLanes) {
            KeyLanes rows[kLanes];
            for (int r = 0; r < kLanes; r++) rows[r] = token0 + r < n ? key_lanes(keys[token0 + r], d0) : KeyLanes{};
            transpose_lanes(rows);
            for (int c = 0; c < kLanes; c++) store_lanes(keys_t + (d0 + c) * kStride + token0, rows[c]);
        }
}
#else
template <int64_t DIM, typename T>
inline void keys_to_columns(const T *const *keys, int64_t n, int64_t padded, float *keys_t) {
    for (int64_t t = 0; t < padded; t++)
        for (int64_t d = 0; d < DIM; d++) keys_t[d * kStride + t] = t < n ? to_float(keys[t][d]) : 0.0f;
}
#endif

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
// Scores from bf16 pairs with the CPU's bf16 dot product (AVX512_BF16: 32 products a instruction, the
// fp32 path's 16, and the keys copied as 32-bit pairs instead of converted): key_pairs [DIM/2][kChunk]
// holds (k[t][2i], k[t][2i+1]) per token t (the chunk's column of [DIM/2][kStride]), query_pairs [ROWS][DIM/2]
// the unscaled bf16 queries; scores in rows of kStride.
template <int64_t ROWS, int64_t DIM>
inline void score_rows_bf16(const uint32_t *__restrict query_pairs, const uint32_t *__restrict key_pairs,
                            float scale, float *__restrict scores) {
    __m512 sums[ROWS][kChunkVecs];
    for (int64_t r = 0; r < ROWS; r++)
        for (int64_t c = 0; c < kChunkVecs; c++) sums[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < DIM / 2; i++) {
        __m512bh keys[kChunkVecs];
        for (int64_t c = 0; c < kChunkVecs; c++)
            keys[c] = (__m512bh)_mm512_loadu_si512(key_pairs + i * kStride + c * kLanes);
        for (int64_t r = 0; r < ROWS; r++) {
            const __m512bh query = (__m512bh)_mm512_set1_epi32(static_cast<int>(query_pairs[r * DIM / 2 + i]));
            for (int64_t c = 0; c < kChunkVecs; c++) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], keys[c], query);
        }
    }
    for (int64_t r = 0; r < ROWS; r++)
        for (int64_t c = 0; c < kChunkVecs; c++)
            _mm512_storeu_ps(scores + r * kStride + c * kLanes, _mm512_mul_ps(sums[r][c], _mm512_set1_ps(scale)));
}

// acc[r] = acc[r] * rescale[r] + sum over the segment's n tokens of weight[r][t] * value[t], two tokens a bf16
// dot product: weight_pairs [ROWS][kStride/2] and value_pairs [kSegment/2][DIM] as Scratch holds them (weights
// past a row's tokens are 0, and values past the segment's).
template <int64_t ROWS, int64_t DIM>
inline void accumulate_rows_bf16(float *__restrict acc, const float *__restrict rescale,
                                 const uint32_t *__restrict weight_pairs, const uint32_t *__restrict value_pairs,
                                 int64_t n) {
    constexpr int64_t kVecs = DIM / kLanes;
    __m512 sums[ROWS][kVecs];
    for (int64_t r = 0; r < ROWS; r++)
        for (int64_t v = 0; v < kVecs; v++)
            sums[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * DIM + v * kLanes), _mm512_set1_ps(rescale[r]));
    for (int64_t t = 0; t < (n + 1) / 2; t++) {
        __m512bh value[kVecs];
        for (int64_t v = 0; v < kVecs; v++)
            value[v] = (__m512bh)_mm512_loadu_si512(value_pairs + t * DIM + v * kLanes);
        for (int64_t r = 0; r < ROWS; r++) {
            const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[r * kStride / 2 + t]));
            for (int64_t v = 0; v < kVecs; v++) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], value[v], weight);
        }
    }
    for (int64_t r = 0; r < ROWS; r++)
        for (int64_t v = 0; v < kVecs; v++) _mm512_storeu_ps(acc + r * DIM + v * kLanes, sums[r][v]);
}

// 2^x lane by lane for x >= -126 (less is taken as -126: 2^-126 ~ 1e-38, a weight of ~0), to bf16's
// needs: a degree-4 polynomial in x's fraction (relative error 2.7e-6, the rounding to bf16's 8 bits
// ~2e-3) scaled by 2^round(x) in one instruction. A third of the ops of exp_nonpositive, whose 1e-7 the
// fp32 path keeps.
inline __m512 exp2_for_bf16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.560510516166687e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591703951358795e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024981260299683e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931219696998596e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999991655349731e-1f));
    return _mm512_scalef_ps(p, n);
}

// softmax_step for the bf16 dot-product path: the weights go straight to bf16 pairs (tokens 2t and 2t+1 in
// pairs[t], as accumulate_rows_bf16 reads them; round to nearest even) from a cheaper exp (exp2_for_bf16),
// the total summing them unrounded. The softmax had been a fifth of a 1,000-token prefill's attention:
// 0.91-0.94x the time with this (kernel A/B, alternating rounds).
// Its scores are taken times `scale` (the tiles' are stored unscaled: the scale rides on the exp's multiply).
inline float softmax_step_pairs(const float *score, int64_t valid, int64_t padded, float &running_max, float &total,
                                uint32_t *pairs, float scale) {
    if (valid <= 0) {
        for (int64_t t = 0; t < padded; t += kChunk) _mm512_storeu_si512(pairs + t / 2, _mm512_setzero_si512());
        return 1.0f;
    }
    const float rescale = move_max(score, valid, running_max, scale);
    const __m512 log2e = _mm512_set1_ps(scale * 1.44269504088896341f), offset = _mm512_set1_ps(-running_max * 1.44269504088896341f);
    const auto weights = [&](int64_t t) {  // the 16 weights from token t, zeros past `valid`
        const int64_t in = valid - t;
        const __mmask16 mask = in >= kLanes ? 0xffff : in <= 0 ? 0 : static_cast<__mmask16>((1u << in) - 1);
        return _mm512_maskz_mov_ps(mask, exp2_for_bf16(_mm512_fmadd_ps(_mm512_loadu_ps(score + t), log2e, offset)));
    };
    __m512 sums = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += kChunk) {
        if (t >= valid) {
            _mm512_storeu_si512(pairs + t / 2, _mm512_setzero_si512());
            continue;
        }
        const __m512 low = weights(t), high = weights(t + kLanes);
        sums = _mm512_add_ps(sums, _mm512_add_ps(low, high));
        _mm512_storeu_si512(pairs + t / 2, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
    total = total * rescale + _mm512_reduce_add_ps(sums);
    return rescale;
}

// A segment's keys as bf16 pairs, [DIM/2][kStride] (token t's pair i at i * kStride + t; zeros past n tokens
// to the end of their chunk), transposed 16 tokens x 16 pairs at a time in registers: a 4-byte copy per pair
// cost as much as the scores' arithmetic.
template <int64_t DIM>
inline void keys_to_pairs(const uint16_t *const *keys, int64_t n, uint32_t *key_pairs) {
    constexpr int64_t kPairs = DIM / 2;
    for (int64_t token0 = 0; token0 < (n + kChunk - 1) / kChunk * kChunk; token0 += 16)
        for (int64_t pair0 = 0; pair0 < kPairs; pair0 += 16) {
            const int64_t cols = kPairs - pair0 < 16 ? kPairs - pair0 : 16;
            const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
            __m512i rows[16];
            for (int r = 0; r < 16; r++)
                rows[r] = token0 + r < n ? _mm512_maskz_loadu_epi32(mask, reinterpret_cast<const int32_t *>(keys[token0 + r]) + pair0)
                                         : _mm512_setzero_si512();
            transpose_lanes(rows);
            for (int64_t c = 0; c < cols; c++)
                _mm512_storeu_si512(key_pairs + (pair0 + c) * kStride + token0, rows[c]);
        }
}

// A segment's values as bf16 pairs of tokens, [kSegment/2][DIM] (tokens 2t and 2t+1 of dimension d at
// t * DIM + d, the second zero past n tokens), interleaved 32 dimensions at a time.
template <int64_t DIM>
inline void values_to_pairs(const uint16_t *const *values, int64_t n, uint32_t *value_pairs) {
    static const __m512i kLow = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    static const __m512i kHigh = _mm512_add_epi16(kLow, _mm512_set1_epi16(16));
    for (int64_t t = 0; t < n; t += 2)
        for (int64_t d = 0; d < DIM; d += 32) {
            const int64_t count = DIM - d < 32 ? DIM - d : 32;
            const __mmask32 mask = count == 32 ? ~0u : (1u << count) - 1;
            const __m512i first = _mm512_maskz_loadu_epi16(mask, values[t] + d);
            const __m512i second = t + 1 < n ? _mm512_maskz_loadu_epi16(mask, values[t + 1] + d) : _mm512_setzero_si512();
            uint32_t *to = value_pairs + t / 2 * DIM + d;
            _mm512_storeu_si512(to, _mm512_permutex2var_epi16(first, kLow, second));
            if (count > 16) _mm512_storeu_si512(to + 16, _mm512_permutex2var_epi16(first, kHigh, second));
        }
}
#else
constexpr bool kBf16Dot = false;
template <int64_t ROWS, int64_t DIM>
inline void score_rows_bf16(const uint32_t *, const uint32_t *, float, float *) {}
template <int64_t ROWS, int64_t DIM>
inline void accumulate_rows_bf16(float *, const float *, const uint32_t *, const uint32_t *, int64_t) {}
inline float softmax_step_pairs(const float *, int64_t, int64_t, float &, float &, uint32_t *, float) { return 1.0f; }
template <int64_t DIM>
inline void keys_to_pairs(const uint16_t *const *, int64_t, uint32_t *) {}
template <int64_t DIM>
inline void values_to_pairs(const uint16_t *const *, int64_t, uint32_t *) {}
#endif

#if defined(PARROT_AMX)
// The pairs' products on AMX tiles (common.h), for head sizes of whole 32s. The pair layouts above are already
// the tiles' operands: query_pairs rows and weight_pairs rows are 16 rows x 32 bf16 (A), key_pairs' rows of
// 16 tokens and value_pairs' rows of 16 dimensions are 16 pairs x 16 columns (B). Rows go 16 at a time, the
// last tile padded past the call's rows (kTilePadRows); all 8 tiles are 16 rows of 64 bytes.
constexpr bool kTiles = true;

void configure_attention_tiles() { configure_tiles({16, 16, 16, 16, 16, 16, 16, 16}); }

// Scores (unscaled: the softmax's exp applies the scale) of `count` rows against a segment's `padded` tokens,
// row tile by row tile: tiles 0-1 a chunk's sums (tokens 0-15, 16-31), 2-3 the tile's queries, kept while all
// its chunks go by for head sizes up to 64 (loaded a chunk at a time for larger ones), 4-7 the keys.
// `between(chunk)` runs after each chunk of the first row tile (the next segment's prefetches). The tile stores
// cost about as much as the multiply-adds they follow (a loop of this here: 43 cycles a multiply-add without
// them, 70-105 with), so the scale is not a pass of its own over the stored scores (the softmax applies it).
template <int64_t DIM, typename F>
inline void score_segment_tiles(const uint32_t *query_pairs, const uint32_t *key_pairs, int64_t count, int64_t padded,
                                float *scores, F between) {
    constexpr bool kept = DIM <= 64;
    for (int64_t r = 0; r < count; r += 16) {
        const uint32_t *queries = query_pairs + r * DIM / 2;
        if constexpr (kept) {
            _tile_loadd(2, queries, DIM * 2);
            if constexpr (DIM == 64) _tile_loadd(3, queries + 16, DIM * 2);
        }
        for (int64_t chunk = 0; chunk < padded; chunk += kChunk) {
            const uint32_t *keys = key_pairs + chunk;
            _tile_zero(0);
            _tile_zero(1);
            if constexpr (kept) {
                _tile_loadd(4, keys, kStride * 4);
                _tile_loadd(5, keys + 16, kStride * 4);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(1, 2, 5);
                if constexpr (DIM == 64) {
                    _tile_loadd(6, keys + 16 * kStride, kStride * 4);
                    _tile_loadd(7, keys + 16 * kStride + 16, kStride * 4);
                    _tile_dpbf16ps(0, 3, 6);
                    _tile_dpbf16ps(1, 3, 7);
                }
            } else {
                for (int64_t d = 0; d < DIM; d += 32) {
                    _tile_loadd(2, queries + d / 2, DIM * 2);
                    _tile_loadd(4, keys + d / 2 * kStride, kStride * 4);
                    _tile_loadd(5, keys + d / 2 * kStride + 16, kStride * 4);
                    _tile_dpbf16ps(0, 2, 4);
                    _tile_dpbf16ps(1, 2, 5);
                }
            }
            _tile_stored(0, scores + r * kStride + chunk, kStride * 4);
            _tile_stored(1, scores + r * kStride + chunk + 16, kStride * 4);
            if (r == 0) between(chunk);
        }
    }
}

// Dimensions [d0, d0 + 32) of 32 rows' weighted values over `steps` steps of 32 tokens, into sums (rows DIM
// apart): two tiles of rows share each load of values. Tiles 0-1 rows 0-15's sums, 2-3 rows 16-31's, 4-5 the
// rows' weights, 6-7 the values (1.18x value_tiles' rate in a loop of them over data in L1).
template <int64_t DIM>
inline void value_tiles_two_rows(const uint32_t *weight_pairs, const uint32_t *value_pairs, int64_t steps, int64_t d0,
                                 float *sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < steps; step++) {
        const uint32_t *values = value_pairs + step * 16 * DIM + d0;
        _tile_loadd(4, weight_pairs + step * 16, kStride * 2);
        _tile_loadd(5, weight_pairs + 16 * kStride / 2 + step * 16, kStride * 2);
        _tile_loadd(6, values, DIM * 4);
        _tile_loadd(7, values + 16, DIM * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sums + d0, DIM * 4);
    _tile_stored(1, sums + d0 + 16, DIM * 4);
    _tile_stored(2, sums + 16 * DIM + d0, DIM * 4);
    _tile_stored(3, sums + 16 * DIM + d0 + 16, DIM * 4);
}

// Dimensions [d0, d0 + 16 * TILES) of 16 rows' weighted values over `steps` steps of 32 tokens, into
// sums (rows DIM apart): tiles 0..TILES-1 the sums, 4 the rows' weights, 5-7 the values in turn.
template <int64_t DIM, int TILES>
inline void value_tiles(const uint32_t *weight_pairs, const uint32_t *value_pairs, int64_t steps, int64_t d0,
                        float *sums) {
    _tile_zero(0);
    if (TILES > 1) _tile_zero(1);
    if (TILES > 2) _tile_zero(2);
    if (TILES > 3) _tile_zero(3);
    for (int64_t step = 0; step < steps; step++) {
        const uint32_t *values = value_pairs + step * 16 * DIM + d0;
        _tile_loadd(4, weight_pairs + step * 16, kStride * 2);
        _tile_loadd(5, values, DIM * 4);
        _tile_dpbf16ps(0, 4, 5);
        if (TILES > 1) {
            _tile_loadd(6, values + 16, DIM * 4);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (TILES > 2) {
            _tile_loadd(7, values + 32, DIM * 4);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (TILES > 3) {
            _tile_loadd(5, values + 48, DIM * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, sums + d0, DIM * 4);
    if (TILES > 1) _tile_stored(1, sums + d0 + 16, DIM * 4);
    if (TILES > 2) _tile_stored(2, sums + d0 + 32, DIM * 4);
    if (TILES > 3) _tile_stored(3, sums + d0 + 48, DIM * 4);
}

// accumulate_rows_bf16 for `count` rows on tiles: a tile's segment sums made from zero, then added to the
// rows' scaled sums. value_pairs past the segment's n tokens are zeroed to the last step's end first (their
// weights are 0, but 0 x an earlier segment's inf would not be).
template <int64_t DIM>
inline void accumulate_rows_tiles(float *acc, const float *rescale, const uint32_t *weight_pairs, uint32_t *value_pairs,
                                  int64_t n, int64_t count) {
    const int64_t steps = (n + 31) / 32;
    std::memset(value_pairs + (n + 1) / 2 * DIM, 0, sizeof(uint32_t) * (steps * 16 - (n + 1) / 2) * DIM);
    alignas(64) float sums[32 * DIM];
    for (int64_t r = 0, rows; r < count; r += rows) {
        const uint32_t *weights = weight_pairs + r * kStride / 2;
        rows = count - r > 16 ? 32 : 16;  // the second tile's rows past count are padding, dropped
        if (rows == 32) {
            for (int64_t d0 = 0; d0 < DIM; d0 += 32) value_tiles_two_rows<DIM>(weights, value_pairs, steps, d0, sums);
        } else {
            int64_t d0 = 0;
            for (; d0 + 64 <= DIM; d0 += 64) value_tiles<DIM, 4>(weights, value_pairs, steps, d0, sums);
            if (d0 < DIM) value_tiles<DIM, 2>(weights, value_pairs, steps, d0, sums);  // DIM % 64 == 32
        }
        for (int64_t row = r; row < count && row < r + rows; row++)
            for (int64_t d = 0; d < DIM; d += kLanes) {
                float *to = acc + row * DIM + d;
                _mm512_storeu_ps(to, _mm512_fmadd_ps(_mm512_loadu_ps(to), _mm512_set1_ps(rescale[row]),
                                                     _mm512_loadu_ps(sums + (row - r) * DIM + d)));
            }
    }
}
#else
constexpr bool kTiles = false;
void configure_attention_tiles() {}
template <int64_t DIM, typename F>
inline void score_segment_tiles(const uint32_t *, const uint32_t *, int64_t, int64_t, float *, F) {}
template <int64_t DIM>
inline void accumulate_rows_tiles(float *, const float *, const uint32_t *, uint32_t *, int64_t, int64_t) {}
#endif

constexpr int64_t kRowBlock = 4;  // rows scored together: 4 x 2 score and 4 x DIM/16 value accumulators
// Tokens whose values all of a task's rows add before the next tokens' (accumulate_segment).
constexpr int64_t kValueRun = 64;
// Many rows (a prefix's tile) score 8 at a time: 16 accumulators per key load, fewer loads per FMA.
constexpr int64_t kScoreRows = 8;

// Whether `count` rows read a chunk's keys transposed (score_rows) or as rows (dot_rows).
inline bool transposed(int64_t count) { return count > kRowBlock; }

// f(std::integral_constant<int64_t, rows>{}) for 1 <= rows <= kRowBlock: the row count the kernels unroll
// over, for the rows left after whole blocks (0 rows: nothing).
template <typename F>
inline void with_rows(int64_t rows, F f) {
    switch (rows) {
        case 4: return f(std::integral_constant<int64_t, 4>{});
        case 3: return f(std::integral_constant<int64_t, 3>{});
        case 2: return f(std::integral_constant<int64_t, 2>{});
        case 1: return f(std::integral_constant<int64_t, 1>{});
    }
}
static_assert(kRowBlock == 4, "with_rows covers 1..kRowBlock rows");

// Scores of rows [first, first + count) against a chunk's keys: those at `chunk` tokens into the segment's
// (s.key_pairs on the bf16 dot-product path, scaled by `scale` once scored; else s.keys_t, or key_rows, the
// segment's fp32 key rows, for few rows).
template <int64_t DIM>
void score_chunk(Scratch &s, int64_t first, int64_t count, int64_t chunk, int64_t n, bool pairs, float scale,
                 const float *const *key_rows) {
    float *scores = s.scores.data() + first * kStride + chunk;
    const float *queries = s.queries.data() + first * DIM;
    int64_t r = 0;
    if (pairs) {
        const uint32_t *query_pairs = s.query_pairs.data() + first * DIM / 2, *keys = s.key_pairs.data() + chunk;
        for (; r + kScoreRows <= count; r += kScoreRows)
            score_rows_bf16<kScoreRows, DIM>(query_pairs + r * DIM / 2, keys, scale, scores + r * kStride);
        for (; r + kRowBlock <= count; r += kRowBlock)
            score_rows_bf16<kRowBlock, DIM>(query_pairs + r * DIM / 2, keys, scale, scores + r * kStride);
        with_rows(count - r, [&](auto rows) {
            score_rows_bf16<decltype(rows)::value, DIM>(query_pairs + r * DIM / 2, keys, scale, scores + r * kStride);
        });
    } else if (transposed(count)) {
        const float *keys_t = s.keys_t.data() + chunk;
        for (; r + kScoreRows <= count; r += kScoreRows)
            score_rows<kScoreRows, DIM>(queries + r * DIM, keys_t, scores + r * kStride);
        for (; r + kRowBlock <= count; r += kRowBlock)
            score_rows<kRowBlock, DIM>(queries + r * DIM, keys_t, scores + r * kStride);
        with_rows(count - r, [&](auto rows) {
            score_rows<decltype(rows)::value, DIM>(queries + r * DIM, keys_t, scores + r * kStride);
        });
    } else {
        with_rows(count, [&](auto rows) {
            dot_rows<decltype(rows)::value, DIM>(queries, key_rows + chunk, n, scores);
        });
    }
}

// The segment's weighted values added to rows [first, first + count), their sums first scaled by `rescale`
// (value_rows: the segment's fp32 value rows, off the pair paths).
template <int64_t DIM>
void accumulate_segment(Scratch &s, int64_t first, int64_t count, const float *rescale, int64_t n, bool pairs,
                        const float *const *value_rows) {
    float *acc = s.acc.data() + first * DIM;
    int64_t r = 0;
    if constexpr (DIM % 32 == 0) if (pairs && s.tiles) {
        accumulate_rows_tiles<DIM>(acc, rescale, s.weight_pairs.data() + first * kStride / 2, s.value_pairs.data(), n,
                                   count);
        return;
    }
    if (pairs) {  // the values too go through the bf16 dot product, weights rounded to bf16 (as flash attention does)
        const uint32_t *weight_pairs = s.weight_pairs.data() + first * kStride / 2, *values = s.value_pairs.data();
        for (; r + kRowBlock <= count; r += kRowBlock)
            accumulate_rows_bf16<kRowBlock, DIM>(acc + r * DIM, rescale + r, weight_pairs + r * kStride / 2, values, n);
        with_rows(count - r, [&](auto rows) {
            accumulate_rows_bf16<decltype(rows)::value, DIM>(acc + r * DIM, rescale + r, weight_pairs + r * kStride / 2,
                                                             values, n);
        });
        return;
    }
    // A run of the segment's tokens at a time, all the rows over it: its values (16 KB at 64 dimensions) stay in L1
    // while each block of rows reads them, where a whole segment's (64 KB) came from L2 again for every block.
    for (int64_t t = 0; t == 0 || t < n; t += kValueRun) {  // no tokens: the sums scaled all the same
        const int64_t run = std::min(kValueRun, n - t);
        const float *weights = s.weights.data() + first * kStride + t, *const *values = value_rows + t;
        const auto scales = [&](int64_t row) { return t ? nullptr : rescale + row; };  // later runs: already scaled
        for (r = 0; r + kRowBlock <= count; r += kRowBlock)
            accumulate_rows<kRowBlock, DIM>(acc + r * DIM, scales(r), weights + r * kStride, values, run);
        with_rows(count - r, [&](auto rows) {
            accumulate_rows<decltype(rows)::value, DIM>(acc + r * DIM, scales(r), weights + r * kStride, values, run);
        });
    }
}

// Cache rows (count of them) asked into L2 before they are read: a step's caches are cold (the layers' weights
// streamed through since), and a decode of 16 sequences over 900 tokens ran 1.5-2x slower from DRAM than from
// cache. A segment's values are asked for before its scores are made, the next segment's rows while they are.
template <int64_t DIM, typename T>
inline void prefetch_rows(const T *const *rows, int64_t count) {
    for (int64_t t = 0; t < count; t++)
        for (size_t byte = 0; byte < DIM * sizeof(T); byte += 64)
            __builtin_prefetch(reinterpret_cast<const char *>(rows[t]) + byte, 0, 2);
}

// The rows of a segment's keys and values, and how many: the next's, prefetched during this one.
template <typename T>
struct SegmentRows {
    const T *keys[kSegment], *values[kSegment];
    int64_t n = 0;
};

// A segment's n cache rows as fp32 rows: fp32 ones where the cache holds them, bf16 ones converted into
// `converted` (`rows` pointing to them). fp32 rows read in place instead of copied, with accumulate_segment's
// runs, took 16 fp32 decodes over 100 tokens to 0.77x the time (benchmarks.kernel_revisions;
// docs/benchmarks/kernel_revisions_fp32_rows_in_place.json).
template <int64_t DIM>
inline const float *const *fp32_rows(const float *const *cache_rows, int64_t, float *, const float **) {
    return cache_rows;
}

template <int64_t DIM>
inline const float *const *fp32_rows(const BFloat16 *const *cache_rows, int64_t n, float *converted,
                                     const float **rows) {
    for (int64_t t = 0; t < n; t++) {
        for (int64_t d = 0; d < DIM; d++) converted[t * DIM + d] = to_float(cache_rows[t][d]);
        rows[t] = converted + t * DIM;
    }
    return rows;
}

// Rows [first, first + count) over a segment's tokens (key and value rows of one kv head), row r over its
// first row_ends[r], from its row_starts[r]-th on (a sliding window's first key; null: from the first): all
// scores, then each row's softmax step, then the values.
template <int64_t DIM, typename T>
void attend_segment(Scratch &s, int64_t first, int64_t count, const SegmentRows<T> &rows, const SegmentRows<T> &next,
                    const int64_t *row_ends, const int64_t *row_starts, bool pairs, float scale) {
    const T *const *key_rows = rows.keys, *const *value_rows = rows.values;
    const int64_t n = rows.n;
    prefetch_rows<DIM>(value_rows, n);
    const int64_t padded = (n + kChunk - 1) / kChunk * kChunk;
    const bool by_token = !transposed(count);
    const float *const *key_fp32 = nullptr;  // the key rows as fp32, for few rows
    if (pairs) {  // zeros past the segment's last token (their weights are 0 too)
        keys_to_pairs<DIM>(reinterpret_cast<const uint16_t *const *>(key_rows), n, s.key_pairs.data());
    } else if (by_token) {
        key_fp32 = fp32_rows<DIM>(key_rows, n, s.keys.data(), s.key_rows);
    } else {
        keys_to_columns<DIM>(key_rows, n, padded, s.keys_t.data());
    }
    const int64_t chunks = (n + kChunk - 1) / kChunk, per_chunk = (next.n + chunks - 1) / chunks;
    const auto prefetch_next = [&](int64_t chunk) {  // a chunk's share of the next segment's keys
        const int64_t ahead = chunk / kChunk * per_chunk;
        if (ahead < next.n) prefetch_rows<DIM>(next.keys + ahead, std::min(per_chunk, next.n - ahead));
    };
    const bool tiles = DIM % 32 == 0 && pairs && s.tiles;
    if (tiles) {
        score_segment_tiles<DIM>(s.query_pairs.data() + first * DIM / 2, s.key_pairs.data(), count, padded,
                                 s.scores.data() + first * kStride, prefetch_next);
    } else {
        for (int64_t chunk = 0; chunk < n; chunk += kChunk) {
            prefetch_next(chunk);
            score_chunk<DIM>(s, first, count, chunk, std::min(kChunk, n - chunk), pairs, scale, key_fp32);
        }
    }
    if (row_starts) {  // keys before a row's window: scored with the rest, masked out before its softmax step
        for (int64_t r = 0; r < count; r++)
            if (row_ends[r] > 0) std::fill_n(s.scores.data() + (first + r) * kStride, row_starts[r], -INFINITY);
    }
    float rescale[kTileRows];
    const float *const *value_fp32 = nullptr;  // the value rows as fp32, off the pair paths
    if (pairs) {
        const float score_scale = tiles ? scale : 1.0f;  // the tiles' scores are stored unscaled
        for (int64_t r = first; r < first + count; r++)
            rescale[r - first] = softmax_step_pairs(s.scores.data() + r * kStride, row_ends[r - first], padded,
                                                    s.running_max[r], s.total[r], s.weight_pairs.data() + r * kStride / 2,
                                                    score_scale);
        values_to_pairs<DIM>(reinterpret_cast<const uint16_t *const *>(value_rows), n, s.value_pairs.data());
    } else {
        for (int64_t r = 0; r < count; r++)
            rescale[r] = softmax_step(s.scores.data() + (first + r) * kStride, row_ends[r], padded,
                                      s.running_max[first + r], s.total[first + r], s.weights.data() + (first + r) * kStride);
        value_fp32 = fp32_rows<DIM>(value_rows, n, s.values.data(), s.value_rows);
    }
    accumulate_segment<DIM>(s, first, count, rescale, n, pairs, value_fp32);
}

// Attends rows [first, first + count) of the scratch state over `tokens` of one kv head; with `row_lengths`,
// row r over only the first row_lengths[r] of them (runs nested in one table: a prefill tile's rows, each
// causal up to itself); with `row_firsts`, row r over none before its row_firsts[r]-th (a sliding window's
// first key, which may lie before these tokens: <= 0).
template <int64_t DIM, typename T>
void attend(Scratch &s, int64_t first, int64_t count, const T *k_cache, const T *v_cache, Tokens tokens,
            int64_t kv_head, const Shape &shape, const int64_t *row_lengths = nullptr,
            const int64_t *row_firsts = nullptr) {
    // bf16 scores and sums values through the CPU's bf16 dot product where it has one: the keys and values
    // rearranged into pairs (in registers) once for all rows. Worth it for many rows (a prefix's tile) or a
    // run of a chunk or more; a short run of few rows (a decode's last tokens) converts its keys to fp32 for
    // less. A decode of 16 x 3 rows over 150 tokens: 107 -> 73 us.
    const bool pairs = kBf16Dot && std::is_same_v<T, BFloat16> && (count >= kScoreRows || tokens.length >= kChunk);
    SegmentRows<T> segments[2];  // this segment's rows and the next's
    int64_t row_ends[kTileRows], row_starts[kTileRows], block = 0, offset = 0, start = 0;
    const auto gather = [&](SegmentRows<T> &rows) {  // the next segment's token rows, walking the block table
        rows.n = std::min(kSegment, tokens.length - start);
        for (int64_t t = 0; t < rows.n; t++) {
            const int64_t slot = static_cast<int64_t>(tokens.table[block]) * shape.block_size + offset;
            rows.keys[t] = cache_row<DIM>(k_cache, slot, kv_head, shape);
            rows.values[t] = cache_row<DIM>(v_cache, slot, kv_head, shape);
            if (++offset == shape.block_size) offset = 0, block++;
        }
        start += rows.n;
    };
    gather(segments[0]);
    for (int64_t i = 0, done = 0; segments[i % 2].n > 0; done += segments[i % 2].n, i++) {
        SegmentRows<T> &rows = segments[i % 2], &next = segments[(i + 1) % 2];
        gather(next);
        bool any = false;
        for (int64_t r = 0; r < count; r++) {
            row_ends[r] = row_lengths ? std::max<int64_t>(0, std::min(row_lengths[r] - done, rows.n)) : rows.n;
            if (row_firsts) {  // a row whose window starts past this segment sees none of it: as a run that ended
                row_starts[r] = std::clamp<int64_t>(row_firsts[r] - done, 0, rows.n);
                if (row_starts[r] >= row_ends[r]) row_ends[r] = 0;
            }
            any |= row_ends[r] > 0;
        }
        if (any) attend_segment<DIM>(s, first, count, rows, next, row_ends, row_firsts ? row_starts : nullptr, pairs,
                                     shape.scale);
    }
}

// The first segment of a run's keys and values of one kv head, asked into L2 (see prefetch_rows).
template <int64_t DIM, typename T>
void prefetch_run(const T *k_cache, const T *v_cache, Tokens tokens, int64_t kv_head, const Shape &shape) {
    for (int64_t t = 0; t < std::min(tokens.length, kSegment); t++) {
        const int64_t slot = static_cast<int64_t>(tokens.table[t / shape.block_size]) * shape.block_size + t % shape.block_size;
        const T *rows[2] = {cache_row<DIM>(k_cache, slot, kv_head, shape), cache_row<DIM>(v_cache, slot, kv_head, shape)};
        prefetch_rows<DIM>(rows, 2);
    }
}

// A task: the G query rows of kv head `kv_head` for each member sequence, over the members' shared
// prefix (if any), then each member over its own tokens; writes the members' rows of `out`.
struct Task {
    int64_t kv_head;
    Tokens prefix;  // length 0: none
    std::vector<int64_t> members;
    // A prefix split by tokens between two tasks (see plan_tasks): part 0 its first tokens, part 1 the rest and
    // the members' own; part p leaves its rows' softmax states at the pair's `states` + p x partial_floats(rows),
    // for merge_parts. -1: not split.
    int part = -1;
    int64_t states = 0;  // the pair's first float in the call's partial states
    int64_t prefix_offset = 0;  // the prefix's first token within the whole prefix (part 1: where part 0 ended)
};

// A row's softmax state as a split task leaves it: the running max, the total, then the dim sums.
inline int64_t partial_floats(int64_t rows, int64_t dim) { return rows * (dim + 2); }

// A row's output: its value sums over its softmax total (zeros for a row that saw no tokens at all).
template <int64_t DIM, typename T>
inline void store_row(T *to, const float *sums, float total) {
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < DIM; d++) store(to[d], sums[d] * inverse);
}

// f(first, count, longest) for each run of consecutive members that read the same own table (a prefill
// tile's rows: each reads its tile's tokens up to itself), `longest` the one with the most own tokens: such
// members take one pass over the longest run, each row up to its own length, instead of a pass each (a
// 250-token prefill's attention 0.97x the time; a decode's members each have their own table).
template <typename F>
void for_each_table_group(const Task &task, const int32_t *own_tables, int64_t own_stride, const int32_t *own_lens,
                          F f) {
    for (size_t first = 0, end; first < task.members.size(); first = end) {
        const int32_t *table = own_tables + task.members[first] * own_stride;
        int64_t longest = task.members[first];
        for (end = first + 1; end < task.members.size(); end++) {
            const int64_t b = task.members[end];
            if (std::memcmp(own_tables + b * own_stride, table, own_stride * sizeof(int32_t)) != 0) break;
            if (own_lens[b] > own_lens[longest]) longest = b;
        }
        f(first, end - first, longest);
    }
}

// The scratch's softmax state of rows [0, rows), as merge_parts reads it.
template <int64_t DIM>
void save_partial(const Scratch &s, int64_t rows, float *to) {
    for (int64_t r = 0; r < rows; r++, to += partial_floats(1, DIM)) {
        to[0] = s.running_max[r];
        to[1] = s.total[r];
        std::memcpy(to + 2, s.acc.data() + r * DIM, sizeof(float) * DIM);
    }
}

// Each of the task's rows' first visible token within a run that starts `offset` tokens into the members' prefix
// ++ own tokens (firsts: per member, from the prefix's start), or null where the call has no windows.
inline const int64_t *run_firsts(const Task &task, const int32_t *firsts, int64_t offset, int64_t group,
                                 int64_t *to) {
    if (!firsts) return nullptr;
    for (size_t m = 0; m < task.members.size(); m++)
        for (int64_t g = 0; g < group; g++) to[m * group + g] = firsts[task.members[m]] - offset;
    return to;
}

template <int64_t DIM, typename T>
void run_task(const Task &task, Scratch &s, const T *q, const T *k_cache, const T *v_cache,
              const int32_t *own_tables, int64_t own_stride, const int32_t *own_lens, const int32_t *firsts, T *out,
              const Shape &shape, float *states) {
    constexpr int64_t dim = DIM;
    const int64_t group = shape.group();
    const int64_t rows = group * static_cast<int64_t>(task.members.size());
    for (size_t m = 0; m < task.members.size(); m++) {
        const T *from = q + task.members[m] * shape.q_stride + task.kv_head * group * dim;
        for (int64_t i = 0; i < group * dim; i++) s.queries[m * group * dim + i] = to_float(from[i]) * shape.scale;
        if constexpr (std::is_same_v<T, BFloat16>)  // unscaled: q x scale would round in bf16
            std::memcpy(s.query_pairs.data() + m * group * dim / 2, from, sizeof(T) * group * dim);
    }
    std::fill(s.acc.begin(), s.acc.begin() + rows * dim, 0.0f);
    std::fill(s.running_max.begin(), s.running_max.begin() + rows, -INFINITY);
    std::fill(s.total.begin(), s.total.begin() + rows, 0.0f);
    if (task.prefix.length > 0) {
        // The members' own runs asked into L2 first, to arrive while the prefix computes: a fork's own tokens
        // are few, with little arithmetic a row to hide their DRAM latency behind.
        for_each_table_group(task, own_tables, own_stride, own_lens, [&](size_t, size_t, int64_t longest) {
            prefetch_run<DIM>(k_cache, v_cache, Tokens{own_tables + longest * own_stride, own_lens[longest]},
                              task.kv_head, shape);
        });
        int64_t prefix_firsts[kTileRows];
        attend<DIM>(s, 0, rows, k_cache, v_cache, task.prefix, task.kv_head, shape, nullptr,
                    run_firsts(task, firsts, task.prefix_offset, group, prefix_firsts));
    }
    int64_t own_firsts[kTileRows];  // the own runs start after the whole prefix
    const int64_t *row_firsts = run_firsts(task, firsts, task.prefix_offset + task.prefix.length, group, own_firsts);
    float *const own_states = task.part < 0 ? nullptr : states + task.states + task.part * partial_floats(rows, DIM);
    if (task.part == 0) return save_partial<DIM>(s, rows, own_states);
    for_each_table_group(task, own_tables, own_stride, own_lens, [&](size_t m, size_t count, int64_t longest) {
        int64_t lengths[kTileRows];
        for (size_t i = m; i < m + count; i++)
            for (int64_t g = 0; g < group; g++) lengths[(i - m) * group + g] = own_lens[task.members[i]];
        const Tokens own{own_tables + longest * own_stride, own_lens[longest]};
        if (own.length > 0)
            attend<DIM>(s, m * group, count * group, k_cache, v_cache, own, task.kv_head, shape, count > 1 ? lengths : nullptr,
                        row_firsts ? row_firsts + m * group : nullptr);
        if (task.part == 1) return;
        for (size_t i = m; i < m + count; i++) {
            const int64_t b = task.members[i];
            T *to = out + (b * shape.num_heads + task.kv_head * group) * dim;
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = i * group + g;
                store_row<DIM>(to + g * dim, s.acc.data() + r * dim, s.total[r]);
            }
        }
    });
    if (task.part == 1) save_partial<DIM>(s, rows, own_states);
}

// Each row of a split prefix's two tasks: their states combined (the sums scaled to the larger max, as the
// online softmax does between segments) and written to `out`.
template <int64_t DIM, typename T>
void merge_parts(const Task &task, const float *states, T *out, const Shape &shape) {
    const int64_t group = shape.group(), rows = group * static_cast<int64_t>(task.members.size());
    const float *first = states + task.states, *second = first + partial_floats(rows, DIM);
    for (int64_t r = 0; r < rows; r++) {
        const float *a = first + partial_floats(r, DIM), *b = second + partial_floats(r, DIM);
        const float top = std::max(a[0], b[0]);
        // A part with no tokens (max -inf) weighs 0, not exp(-inf - -inf).
        const float wa = a[0] == -INFINITY ? 0.0f : exp_nonpositive(a[0] - top);
        const float wb = b[0] == -INFINITY ? 0.0f : exp_nonpositive(b[0] - top);
        float sums[DIM];
        for (int64_t d = 0; d < DIM; d++) sums[d] = a[2 + d] * wa + b[2 + d] * wb;
        const int64_t member = task.members[r / group];
        store_row<DIM>(out + (member * shape.num_heads + task.kv_head * group + r % group) * DIM, sums,
                       a[1] * wa + b[1] * wb);
    }
}

// A prefix from which too few tasks split by tokens rather than by members (see plan_tasks).
constexpr int64_t kMinSplitTokens = 256;

// Tiles: each prefix's members, at most tile_rows query rows a tile; a sequence without one alone.
// When that leaves fewer than two tasks a thread (16 forks of a 900-token prompt, 3 kv heads: 3 tasks
// for 2 threads, one idle for a third of the call), a long prefix (kMinSplitTokens) splits by tokens: two
// tasks a tile, each over half the prefix with all the tile's rows, their states merged after (merge_parts).
// A shorter one splits its members into more tiles of equal size, each reading the prefix again. Splitting
// by tokens reads each key once and keeps tiles full: 16 forks of a 912-token prefix 0.82x the time in bf16,
// 0.83x in fp32 (0.89-0.9x at 300 tokens; kernel A/B, alternating rounds).
struct Plan {
    std::vector<Task> tasks;  // longest first
    int64_t state_floats = 0;  // the split tasks' states, all pairs
};

Plan plan_tasks(int64_t batch, const int32_t *prefix_ids, const int32_t *prefix_tables,
                             int64_t prefix_stride, const int32_t *prefix_lens, int64_t num_prefixes,
                             const int32_t *own_lens, const Shape &shape, int64_t tile_rows, int num_threads) {
    const auto prefix_of = [&](int64_t b) {
        const int64_t p = prefix_ids ? prefix_ids[b] : -1;
        return p < 0 || p >= num_prefixes ? -1 : p;
    };
    const int64_t max_members = std::max<int64_t>(1, tile_rows / shape.group());
    std::vector<int64_t> members(num_prefixes, 0), prefix_tiles(num_prefixes);
    int64_t tiles_needed = 0;  // one a sequence without a prefix, as few as fit a prefix's members
    for (int64_t b = 0; b < batch; b++) {
        const int64_t p = prefix_of(b);
        p < 0 ? tiles_needed++ : members[p]++;
    }
    for (int64_t p = 0; p < num_prefixes; p++)
        tiles_needed += prefix_tiles[p] = (members[p] + max_members - 1) / max_members;
    const int64_t wanted_tiles = (2 * num_threads + shape.num_kv_heads - 1) / shape.num_kv_heads;
    const bool too_few = tiles_needed * shape.num_kv_heads < 2 * num_threads;
    std::vector<int64_t> per_tile(num_prefixes), split_at(num_prefixes, 0);
    for (int64_t p = 0; p < num_prefixes; p++) {
        int64_t tiles = prefix_tiles[p];
        const int64_t half = prefix_lens[p] / 2 / shape.block_size * shape.block_size;
        if (too_few && members[p] > 0 && prefix_lens[p] >= kMinSplitTokens && half > 0 && num_threads > 1)
            split_at[p] = half;
        else if (too_few)
            tiles = std::max(tiles, std::min(members[p], wanted_tiles));
        per_tile[p] = tiles ? (members[p] + tiles - 1) / tiles : 1;
    }
    std::vector<std::vector<int64_t>> tiles;
    std::vector<int64_t> tile_prefix;
    std::vector<int64_t> open_tile(num_prefixes, -1);
    for (int64_t b = 0; b < batch; b++) {
        const int64_t p = prefix_of(b);
        if (p < 0) {
            tiles.push_back({b});
            tile_prefix.push_back(-1);
            continue;
        }
        if (open_tile[p] < 0 || static_cast<int64_t>(tiles[open_tile[p]].size()) == per_tile[p]) {
            open_tile[p] = static_cast<int64_t>(tiles.size());
            tiles.emplace_back();
            tile_prefix.push_back(p);
        }
        tiles[open_tile[p]].push_back(b);
    }
    std::vector<Task> tasks;
    int64_t state_floats = 0;
    for (size_t i = 0; i < tiles.size(); i++) {
        const int64_t p = tile_prefix[i];
        const Tokens prefix = p < 0 ? Tokens{nullptr, 0} : Tokens{prefix_tables + p * prefix_stride, prefix_lens[p]};
        for (int64_t h = 0; h < shape.num_kv_heads; h++) {
            if (p < 0 || split_at[p] == 0) {
                tasks.push_back({h, prefix, tiles[i]});
                continue;
            }
            const int64_t split = split_at[p], floats = partial_floats(shape.group() * tiles[i].size(), shape.head_dim);
            tasks.push_back({h, Tokens{prefix.table, split}, tiles[i], 0, state_floats});
            tasks.push_back({h, Tokens{prefix.table + split / shape.block_size, prefix.length - split}, tiles[i], 1,
                             state_floats, split});
            state_floats += 2 * floats;
        }
    }
    // Longest first: threads take tasks in order, and a long one taken last (a prefill's last tile, after
    // the step's decodes) would leave the other threads idle while it runs.
    const auto work = [&](const Task &task) {
        int64_t tokens = task.prefix.length * static_cast<int64_t>(task.members.size());
        for (const int64_t b : task.members) tokens += own_lens[b];
        return tokens;
    };
    std::vector<int64_t> order(tasks.size()), costs(tasks.size());
    for (size_t i = 0; i < tasks.size(); i++) order[i] = static_cast<int64_t>(i), costs[i] = work(tasks[i]);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
    std::vector<Task> sorted;
    sorted.reserve(tasks.size());
    for (const int64_t i : order) sorted.push_back(std::move(tasks[i]));
    return {std::move(sorted), state_floats};
}

template <int64_t DIM, typename T>
void run_tasks(const Plan &plan, const T *q, const T *k_cache, const T *v_cache,
               const int32_t *own_tables, int64_t own_stride, const int32_t *own_lens, const int32_t *firsts, T *out,
               const Shape &shape, int num_threads) {
    const std::vector<Task> &tasks = plan.tasks;
    // The split tasks' states, kept between calls as the scratch is.
    thread_local std::vector<float> state_buffer;
    if (static_cast<int64_t>(state_buffer.size()) < plan.state_floats) state_buffer.resize(plan.state_floats);
    float *states = state_buffer.data();  // the team's threads each have their own buffer: this thread's, by pointer
#pragma omp parallel num_threads(num_threads)
    {
        // One per thread, kept between calls: allocating (and zeroing) it per call cost more than a short
        // decode's arithmetic.
        thread_local Scratch scratch(kMaxHeadDim, kTileRows);
        scratch.tiles = kTiles && std::is_same_v<T, BFloat16> && DIM % 32 == 0 && tiles_usable();
        if (scratch.tiles) configure_attention_tiles();
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < tasks.size(); i++)
            run_task<DIM>(tasks[i], scratch, q, k_cache, v_cache, own_tables, own_stride, own_lens, firsts, out, shape,
                          states);
        if (scratch.tiles) release_tiles();
        if (plan.state_floats > 0) {  // the same on every thread: all of them meet the loop's barrier or none does
#pragma omp for schedule(dynamic, 1)
            for (size_t i = 0; i < tasks.size(); i++)
                if (tasks[i].part == 1) merge_parts<DIM>(tasks[i], states, out, shape);
        }
    }
}

template <typename T>
int decode(const T *q, const T *k_cache, const T *v_cache, const int32_t *prefix_ids, const int32_t *prefix_tables,
           int64_t prefix_stride, const int32_t *prefix_lens, int64_t num_prefixes, const int32_t *own_tables,
           int64_t own_stride, const int32_t *own_lens, const int32_t *firsts, T *out, int64_t batch, const Shape &shape,
           int num_threads) {
    if (shape.group() > kTileRows) return -1;
    const auto blocks_valid = [&](const int32_t *table, int64_t length) {
        for (int64_t i = 0; i < (length + shape.block_size - 1) / shape.block_size; i++)
            if (table[i] < 0 || table[i] >= shape.num_blocks) return false;
        return true;
    };
    for (int64_t b = 0; b < batch; b++)
        if (!blocks_valid(own_tables + b * own_stride, own_lens[b])) return -2;
    for (int64_t p = 0; p < num_prefixes; p++)
        if (!blocks_valid(prefix_tables + p * prefix_stride, prefix_lens[p])) return -2;
    const Plan plan = plan_tasks(batch, prefix_ids, prefix_tables, prefix_stride, prefix_lens, num_prefixes, own_lens,
                                  shape, kTileRows, num_threads);
    const auto run = [&](auto dim) {
        run_tasks<decltype(dim)::value>(plan, q, k_cache, v_cache, own_tables, own_stride, own_lens, firsts, out, shape,
                                        num_threads);
        return 0;
    };
    switch (shape.head_dim) {  // each head size its own unrolled build; native.HEAD_DIMS lists them
        case 32: return run(std::integral_constant<int64_t, 32>{});
        case 64: return run(std::integral_constant<int64_t, 64>{});
        case 80: return run(std::integral_constant<int64_t, 80>{});
        case 96: return run(std::integral_constant<int64_t, 96>{});
        case 128: return run(std::integral_constant<int64_t, 128>{});
        case 256: return run(std::integral_constant<int64_t, 256>{});
        default: return -1;
    }
}

}  // namespace

extern "C" {

// Each sequence b attends to prefix prefix_ids[b] (rows of prefix_tables / prefix_lens; -1 or a null
// prefix_ids: none), then to the first own_lens[b] tokens of own_tables' row b, none before its firsts[b]-th
// token counted from its prefix's first (a sliding window's first key; a null firsts: all); its queries are at
// q + b * q_stride, out is contiguous [batch, num_heads, head_dim]. Returns 0; -1 when
// this build has no kernel for head_dim or the query group; -2 when a table names a block past
// num_blocks (nothing is read then).
// (c_api.h declares them with bf16 as its 16 bits; the kernels read them as BFloat16, the same bytes.)
#define PARROT_DECODE(NAME, C, T)                                                                            \
    PARROT_DECODE_SIGNATURE(NAME, C) {                                                                       \
        const Shape shape{num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, q_stride};      \
        return decode(reinterpret_cast<const T *>(q), reinterpret_cast<const T *>(k_cache),                  \
                      reinterpret_cast<const T *>(v_cache), prefix_ids, prefix_tables, prefix_stride, prefix_lens, \
                      num_prefixes, own_tables, own_stride, own_lens, firsts, reinterpret_cast<T *>(out), batch, \
                      shape, num_threads);                                                                   \
    }

PARROT_DECODE(parrot_decode_f32, float, float)
PARROT_DECODE(parrot_decode_bf16, uint16_t, BFloat16)

// Stores each new token's key and value rows (row_elems = KVH x D each, contiguous; key_stride and
// value_stride elements from one token's to the next's) at its slot; slot -1 is skipped. Returns 0, or -1
// (nothing written) when a slot is past the cache's num_slots.
#define PARROT_WRITE_KV(NAME, T)                                                                             \
    PARROT_WRITE_KV_SIGNATURE(NAME, T) {                                                                     \
        for (int64_t t = 0; t < num_tokens; t++)                                                             \
            if (slots[t] >= num_slots || slots[t] < -1) return -1;                                           \
        for (int64_t t = 0; t < num_tokens; t++) {                                                           \
            if (slots[t] < 0) continue;                                                                      \
            std::memcpy(k_cache + slots[t] * row_elems, key + t * key_stride, sizeof(T) * row_elems);        \
            std::memcpy(v_cache + slots[t] * row_elems, value + t * value_stride, sizeof(T) * row_elems);    \
        }                                                                                                    \
        return 0;                                                                                            \
    }

PARROT_WRITE_KV(parrot_write_kv_f32, float)
PARROT_WRITE_KV(parrot_write_kv_bf16, uint16_t)

}  // extern "C"
