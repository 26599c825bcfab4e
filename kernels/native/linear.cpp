// A linear layer at any row count: out = x @ weight.T (+ bias), x [M, K] and out [M, N] contiguous, the
// [N, K] weight packed by kernels/native.py's pack_linear() as [N/32][K/P][32][P]: for each block of 32
// output features, P inputs at a time (P = 2 bf16, a pair the CPU's bf16 dot product takes, or 1 fp32), so a
// block is one sequential stream and each step of it is two AVX-512 vectors of weights (four AVX2).
//
// Why: a decode step of a small model is one pass over every weight with a few rows, too few for a GEMM
// library's blocking to pay off. Each input value (pair) is broadcast to a vector and multiplies the
// block's weight vectors, up to 12 rows at once on AVX-512 (24 accumulators in registers; 6 rows over half a
// block on AVX2), no horizontal sums.
// Over SmolLM2's 120 decoder linears (`python benchmarks/kernels.py --cpu`, "linear" rows) that streams the
// weights at a plain read's rate for 1-8 rows. On CPUs with AMX, bf16 rows go through tiles instead (below),
// level with or ahead of oneDNN's prepacked GEMM at every row count; fp32 rows take the vector path at every row
// count too, level with or ahead of torch's MKL GEMM here (kernels/native_linear.py).
//
// bf16 sums pairs in fp32 (vdpbf16ps, or on CPUs without it weights widened to fp32 as they are read) and rounds to
// bf16 to nearest even, as torch does; fp32 uses fused multiply-adds. Built with the attention kernels by kernels/native.py.
//
// The gated variant is an MLP's first half, silu(x @ gate.T) * (x @ up.T), from one packed [2I, K] weight
// whose gate and up blocks alternate (kernels/native.py's pack_gated_linear): a thread computes a gate block
// and its up block back to back and writes only their product, rounding where torch's unfused ops round
// (gate, up and silu(gate) to the dtype, then the product). A 1,000-token bf16 prefill wrote and re-read
// 6 MB of gate and up a layer, and the separate silu-and-multiply kernel was ~3% of its time.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "c_api.h"
#include "common.h"

namespace {

constexpr int kBlockVecs = kBlockCols / kLanes;  // a row's sums of a whole block
// Beyond a few rows a pass takes a block's features in parts of two vectors: the whole block on AVX-512, halves
// on AVX2, where whole blocks left room for the sums of only 2 rows (3 spilled one to the stack); over halves
// 6 rows a pass read each weight a third as often: SmolLM2's fp32 linears 0.83x the time at 16 rows, 0.71-0.73x
// at 112-1,024 (benchmarks.kernel_revisions on an AMD EPYC). Up to 2 rows a pass takes whole blocks: it streams
// the weights, and reading a block's halves in two passes took 1.19x the time at 1 row.
constexpr int kPartVecs = 2;
constexpr int kFewRows = 2;
template <int rows>
constexpr int kRowVecs = rows <= kFewRows ? kBlockVecs : kPartVecs;

// Sums a pass keeps in registers (common.h's kVecRegisters) beside a step of its weights and a broadcast input:
// 24 on AVX-512 (12 rows), 12 on AVX2 over halves (6 rows).
template <int vecs>
constexpr int kSumBudget = std::min<int>(24, kVecRegisters - vecs - 2);

// Which of a unit's passes over its weights this is (a unit is read once per pass of rows).
struct Pass {
    int64_t index, count;
};

// The next block's weights asked into L2 while this block's are read: a thread's blocks follow each other in
// memory, and the hardware's prefetchers stop at each 4 KB page and leave the memory idle while a block's later
// passes (or its tile products) compute. Pass i of n asks for the next block's steps i, i + n, ..., one every n
// of its own steps, so that the requests spread over all the unit's passes instead of crowding the first.
// SmolLM2's decoder linears at 1-16 rows took 0.75-0.85x the time with this (bf16 tiles and fp32 alike; fp32's
// 16 rows, two passes, 0.85x more from the spreading; kernel A/B, alternating rounds), the 2-core stream
// reaching 17-27 GB/s where a plain read does ~22 here. The last block's requests past the weight are harmless:
// a prefetch never faults. On AVX2 builds (measured on an AMD EPYC, Zen 3) a block read in one pass streams
// best with the hardware's prefetchers alone: 30 layers' 1-row fp32 linears 0.85x the time without these
// requests, while without them 4 and 16 rows (a block's halves in separate passes) took 1.2x and 1.36x. AVX-512
// builds keep them in single passes too, as measured on Intel's parts.
#if defined(__AVX512F__)
constexpr bool kPrefetchSinglePass = true;
#else
constexpr bool kPrefetchSinglePass = false;
#endif

class NextBlockPrefetch {
public:
    NextBlockPrefetch(const void *next_block, int64_t step_bytes, Pass pass)
        : next_(static_cast<const char *>(next_block)), step_bytes_(step_bytes), target_(pass.index), every_(pass.count),
          countdown_(pass.count > 1 || kPrefetchSinglePass ? 0 : INT64_MAX) {}

    void step() {  // once per step of this block
        if (countdown_-- > 0) return;
        for (int64_t line = 0; line < step_bytes_; line += 64) __builtin_prefetch(next_ + target_ * step_bytes_ + line, 0, 2);
        target_ += every_;
        countdown_ = every_ - 1;
    }

private:
    const char *next_;
    int64_t step_bytes_, target_, every_, countdown_;
};

// One dtype's arithmetic: Weights is the vectors of a block's step, Input one row's broadcast step.
template <typename T>
struct Ops;

template <>
struct Ops<float> {
    static constexpr int64_t kPack = 1;
    typedef float Input;  // what a pass reads its rows as
    template <int rows>
    static constexpr int kVecs = kRowVecs<rows>;  // a row's sums of a part of a block
    typedef Vec Sum;
    static Sum zero() { return Vec{}; }
    template <int vecs>
    static std::array<Vec, vecs> weights(const float *step) {
        std::array<Vec, vecs> w;
        for (int v = 0; v < vecs; v++) w[v] = load(step + v * kLanes);
        return w;
    }
    static Vec input(const float *x) { return splat(*x); }
    static void multiply_add(Sum &sum, Vec input, Vec weight) { sum += input * weight; }
    static void store(float *to, Sum sum, const float *bias) {
        if (bias) sum += load(bias);
        save(to, sum);
    }
    static void save_sum(float *to, Sum sum) { save(to, sum); }
    static Sum loaded(const float *sums) { return load(sums); }
    static Vec rounded(Vec x) { return x; }  // as the dtype holds it
    static void store(float *to, Vec x) { save(to, x); }
};

#if defined(__AVX512BF16__)
template <>
struct Ops<uint16_t> {
    static constexpr int64_t kPack = 2;
    typedef uint16_t Input;
    template <int rows>
    static constexpr int kVecs = kBlockVecs;  // the whole block
    typedef __m512 Sum;
    static Sum zero() { return _mm512_setzero_ps(); }
    template <int vecs>
    static std::array<__m512bh, vecs> weights(const uint16_t *step) {
        static_assert(vecs == 2, "a block's step is two vectors of pairs");
        return {(__m512bh)_mm512_loadu_si512(step), (__m512bh)_mm512_loadu_si512(step + 2 * kLanes)};
    }
    static __m512bh input(const uint16_t *x) {  // the pair x[k], x[k+1] in every lane
        int32_t pair;
        std::memcpy(&pair, x, sizeof pair);
        return (__m512bh)_mm512_set1_epi32(pair);
    }
    static void multiply_add(Sum &sum, __m512bh input, __m512bh weight) { sum = _mm512_dpbf16_ps(sum, input, weight); }
    static __m512 widened(__m256i bf16) {  // bf16 -> fp32 is a shift into the high half
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
    }
    static __m256i narrowed(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // round to nearest even, as torch
    static void store(uint16_t *to, Sum sum, const uint16_t *bias) {
        if (bias) sum = _mm512_add_ps(sum, widened(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(bias))));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(to), narrowed(sum));
    }
    static void save_sum(float *to, Sum sum) { _mm512_storeu_ps(to, sum); }
    static Sum loaded(const float *sums) { return _mm512_loadu_ps(sums); }
    // The gated epilogue's vectors (common.h's Vec: the same 16 floats as __m512) rounded to bf16 and back, or
    // stored as bf16.
    static Vec rounded(Vec x) { return (Vec)widened(narrowed((__m512)x)); }
    static void store(uint16_t *to, Vec x) { _mm256_storeu_si256(reinterpret_cast<__m256i *>(to), narrowed((__m512)x)); }
};
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define PARROT_WIDENED_BF16 1
// bf16 where the CPU has no bf16 dot product (AVX2, as AMD's Zen 2-3): a call's rows are widened to fp32 once
// (CallRows), and each vector of weight pairs to two fp32 vectors as a pass reads it (bf16 -> fp32 is a shift
// into the high half: a pair's first value shifted up, its second masked in place), then
// multiplied as fp32's are, two fused multiply-adds a pair: the weights stream at half fp32's bytes, and the
// widening is two integer operations a weight vector, shared by a pass's rows. torch's bf16 linear on such a CPU
// ran SmolLM2's 1,000-token prefill linears at ~18 GFLOP/s (an eager step 12.4 s, fp32's 2.1 s) and a 16-row
// decode step at 4.4x fp32's time. This way SmolLM2's 30 layers' linears take 0.55-0.68x the fp32 kernel's time
// at 1-4 rows and 0.83-0.99x at 16-1,000 (an AMD EPYC, Zen 3, 2 cores, alternating in one process); widening
// the rows' pairs in every pass as well (a broadcast and two integer operations a row a step) had taken
// 1.23-1.54x from 16 rows on.
template <>
struct Ops<uint16_t> {
    static constexpr int64_t kPack = 2;
    typedef float Input;
    template <int rows>
    static constexpr int kVecs = kRowVecs<rows>;  // a row's sums of a part of a block, as fp32's
    typedef Vec Sum;
    typedef uint32_t Bits __attribute__((vector_size(kLanes * sizeof(uint32_t))));
    typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
    struct Pairs {  // kLanes pairs widened: each lane's first and second value
        Vec first, second;
    };
    static Pairs widened_pairs(Bits pairs) { return {(Vec)(pairs << 16), (Vec)(pairs & 0xffff0000u)}; }
    static Sum zero() { return Vec{}; }
    template <int vecs>
    static std::array<Pairs, vecs> weights(const uint16_t *step) {
        std::array<Pairs, vecs> w;
        for (int v = 0; v < vecs; v++) {
            Bits pairs;
            std::memcpy(&pairs, step + v * kPack * kLanes, sizeof pairs);
            w[v] = widened_pairs(pairs);
        }
        return w;
    }
    static Pairs input(const float *x) { return {splat(x[0]), splat(x[1])}; }  // x[k], x[k+1] in every lane
    static void multiply_add(Sum &sum, const Pairs &input, const Pairs &weight) {
        sum += input.first * weight.first;
        sum += input.second * weight.second;
    }
    static Vec widened(const uint16_t *from) {  // kLanes bf16 values
        Halves halves;
        std::memcpy(&halves, from, sizeof halves);
        return (Vec)(__builtin_convertvector(halves, Bits) << 16);
    }
    static Bits narrowed(Vec x) {  // to nearest even, as torch rounds (common.h's float_to_bf16); NaN stays NaN
        const Bits bits = (Bits)x;
        return (bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    }
    static void store(uint16_t *to, Vec x) {
        const Halves halves = __builtin_convertvector(narrowed(x), Halves);
        std::memcpy(to, &halves, sizeof halves);
    }
    static void store(uint16_t *to, Sum sum, const uint16_t *bias) { store(to, bias ? sum + widened(bias) : sum); }
    static void save_sum(float *to, Sum sum) { save(to, sum); }
    static Sum loaded(const float *sums) { return load(sums); }
    static Vec rounded(Vec x) { return (Vec)(narrowed(x) << 16); }
};
#endif

constexpr int kMaxRows = kSumBudget<kPartVecs> / kPartVecs;  // rows per pass
static_assert(kMaxRows >= 1, "a row's sums fit the registers");

// Where a block's sums go: the layer's output (its bias added, rounded to the dtype), straight from registers.
template <typename T>
struct Output {
    T *out;  // the block's first row and feature
    int64_t out_features;
    const T *bias;  // the block's, or null
    void operator()(int r, int v, typename Ops<T>::Sum sum) const {  // sum v of row r: features from v * kLanes
        Ops<T>::store(out + r * out_features + v * kLanes, sum, bias ? bias + v * kLanes : nullptr);
    }
    void from_sums(const float *sums, int64_t rows) const {  // fp32 sums [rows][kBlockCols] (tiles', or 4-bit's)
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < kBlockVecs; v++) (*this)(r, v, Ops<T>::loaded(sums + r * kBlockCols + v * kLanes));
    }
};

// ... or unrounded fp32 sums [rows][kBlockCols], for an epilogue that combines two blocks (the gated linear).
template <typename T>
struct Sums {
    float *sums;
    void operator()(int r, int v, typename Ops<T>::Sum sum) const {
        Ops<T>::save_sum(sums + r * kBlockCols + v * kLanes, sum);
    }
};

// A pass reads row r's input at step s from x's rows as the caller holds them (row stride in_features), or, when
// `interleaved`, from the pass's rows laid out step by step, [steps][rows][kPack] (interleave below).
template <typename T, int rows, bool interleaved, typename Input = typename Ops<T>::Input>
const Input *row_input(const Input *x, int r, int64_t s, int64_t in_features) {
    constexpr int64_t pack = Ops<T>::kPack;
    return interleaved ? x + (s * rows + r) * pack : x + r * in_features + s * pack;
}

// Rows x one block, its sums to `sink`, a part of the block's features at a time: `unroll` sets of accumulators
// take alternate steps, so that few rows still have enough independent sums in flight to hide the multiply-add
// latency.
template <typename T, int rows, int unroll, bool interleaved, typename Sink>
void block_rows(const T *block, const typename Ops<T>::Input *x, int64_t in_features, Pass pass, Sink sink) {
    using O = Ops<T>;
    constexpr int64_t step = O::kPack * kBlockCols;  // a block's weights per input step
    constexpr int vecs = O::template kVecs<rows>, parts = kBlockVecs / vecs;
    const int64_t steps = in_features / O::kPack;
    for (int part = 0; part < parts; part++) {
        const T *weights = block + part * vecs * kLanes * O::kPack;  // the part's place in each step
        NextBlockPrefetch prefetch(block + kBlockCols * in_features, step * sizeof(T),
                                   Pass{pass.index * parts + part, pass.count * parts});
        typename O::Sum sums[unroll][rows][vecs];
        for (int u = 0; u < unroll; u++)
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < vecs; v++) sums[u][r][v] = O::zero();
        int64_t s = 0;
        for (; s + unroll <= steps; s += unroll)
            for (int u = 0; u < unroll; u++) {
                prefetch.step();
                const auto w = O::template weights<vecs>(weights + (s + u) * step);
                for (int r = 0; r < rows; r++) {
                    const auto input = O::input(row_input<T, rows, interleaved>(x, r, s + u, in_features));
                    for (int v = 0; v < vecs; v++) O::multiply_add(sums[u][r][v], input, w[v]);
                }
            }
        for (; s < steps; s++) {
            const auto w = O::template weights<vecs>(weights + s * step);
            for (int r = 0; r < rows; r++) {
                const auto input = O::input(row_input<T, rows, interleaved>(x, r, s, in_features));
                for (int v = 0; v < vecs; v++) O::multiply_add(sums[0][r][v], input, w[v]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < vecs; v++) {
                auto sum = sums[0][r][v];
                for (int u = 1; u < unroll; u++) sum = sum + sums[u][r][v];
                sink(r, part * vecs + v, sum);
            }
    }
}

template <typename T, typename Sink>
using BlockRows = void (*)(const T *, const typename Ops<T>::Input *, int64_t, Pass, Sink);

// Few rows take alternate steps in up to 4 sets of sums, as many as the registers hold.
template <int rows>
constexpr int kUnroll = std::clamp(kSumBudget<kRowVecs<rows>> / (kRowVecs<rows> * rows), 1, 4);

// instance(std::integral_constant<int, r>) for r = count, among 1..kMaxRows (a pass's rows): the kernel compiled
// for that many rows, or null for another count.
template <typename Instance, int... rows>
auto instance_for_rows(int64_t count, Instance instance, std::integer_sequence<int, rows...>) {
    decltype(instance(std::integral_constant<int, 1>{})) chosen = nullptr;
    ((chosen = count == rows + 1 ? instance(std::integral_constant<int, rows + 1>{}) : chosen), ...);
    return chosen;
}

template <typename Instance>
auto instance_for_rows(int64_t count, Instance instance) {
    return instance_for_rows(count, instance, std::make_integer_sequence<int, kMaxRows>{});
}

template <typename T, typename Sink, bool interleaved>
BlockRows<T, Sink> block_rows_among(int64_t count) {
    const BlockRows<T, Sink> chosen = instance_for_rows(count, [](auto rows) {
        return block_rows<T, rows.value, kUnroll<rows.value>, interleaved, Sink>;
    });
    return chosen ? chosen : block_rows<T, kMaxRows, 1, interleaved, Sink>;
}

// The pass for `rows` rows (at most kMaxRows), reading them in place or interleaved.
template <typename T, typename Sink>
BlockRows<T, Sink> block_rows_for(int64_t rows, bool interleaved = false) {
    return interleaved ? block_rows_among<T, Sink, true>(rows) : block_rows_among<T, Sink, false>(rows);
}

// bf16 rows in tiles on AMX (common.h): the packed weight is already a tile's layout (a block's 16 pairs of
// inputs x 16 features are 16 rows of 64 bytes, 128 bytes apart), so nothing is re-laid out; rows go 32 at a
// time (two tiles of 16), the last few in tiles configured to their count. The sums are fp32, as the vector
// path's; only their order within a tile's 32 inputs differs. On this CPU the vector path ran SmolLM2's
// 1,000-row linears at ~125 GFLOP/s, tiles at ~550-1,100; 4-16 rows (batched decode) 2-2.5x faster too.
constexpr int64_t kTileRows = 32;    // rows a tile pass takes: two tiles of 16
constexpr int64_t kTileInputs = 32;  // inputs a tile multiply-add takes: 16 pairs
// Rows whose input stays in L2 while a thread's weight band passes over them. A chunk re-reads the band from
// L3 (the MLP's gate and up, 3.5 MB, are more than a core's 2 MB L2), so fewer chunks read less: a layer's
// 1,024-row bf16 linears 0.97-0.98x the time at 256 rows against 128, the gated one alone 0.96x; 512 rows
// 0.99x, and 1,024 (the input alone ~L2's size) 1.11x (benchmarks.kernel_revisions, 100 rounds a load order).
constexpr int64_t kChunkRows = 256;
// The vector path's chunks: at most this many bytes of input rows, equal in size, so that a chunk stays in L2
// while a thread's blocks pass over it; in one chunk of all its rows a 1,000-token fp32 prefill's input (2.3 MB
// at 576 features) went back to L3 for every block. Kernel A/B, fp32, 30 rounds a load order
// (benchmarks.kernel_revisions, docs/benchmarks/kernel_revisions_vector_chunks_fp32.json): a layer's 1,024-row
// linears 0.96x the time at 512 KB (up to 227 rows at 576 features, 85 at 1,536), 0.98x at 256 KB and 1 MB;
// fixed 96, 192 and 384-row chunks 0.96x, 0.96x, 0.98x. A call whose input fits is one chunk, as before. (Measured
// in fp32; bf16 without tiles takes the same bytes, twice the rows.)
constexpr int64_t kVectorChunkBytes = 512 << 10;

// A pass's rows of output: the first row's line of the block's outputs, and the rows' distance in bytes.
struct OutputLines {
    const char *first = nullptr;
    int64_t stride = 0;

    template <typename T>
    static OutputLines of(const T *out, int64_t row_elements) {
        return {reinterpret_cast<const char *>(out), row_elements * static_cast<int64_t>(sizeof(T))};
    }
};

// The pass's output lines asked into L1 while its tiles compute, a few a step, spread over all its steps: a
// prefill's output (2 MB for a 1,024-row bf16 QKV) may have left the caches since the allocator last handed it out,
// and then each row's line written after the products missed, the stores queueing behind their lines' reads. In a
// stand-alone loop of 1,024-row calls on one core (SmolLM2's shapes, a fresh-from-DRAM output, alternating in one
// process) the outputs took the tiles' products from 1,185 to 898 GFLOP/s at QKV's 960 x 576 and from 1,095 to 707
// at 3,072 x 576; asked for this way, 987 and 891. In the kernel A/B, whose outputs come from torch's allocator as
// the engine's do (benchmarks.kernel_revisions, bf16, 40-60 rounds a load order, five runs), a layer's 1,024-row
// linears took 0.94-0.97x the time while the unchanged attention measured 1.01-1.05x (112 rows 0.98-0.99x;
// docs/benchmarks/kernel_revisions_output_prefetch_bf16.json); the gated linear, whose silu epilogue follows two
// blocks' products, measured 1.02-1.04x with the requests and has none.
class OutputPrefetch {
public:
    OutputPrefetch(OutputLines out, int64_t rows, int64_t steps)
        : out_(out), rows_(out.first ? rows : 0), steps_(steps) {}

    void step() {  // once per step of the pass
        const int64_t want = ++step_ * rows_ / steps_;
        for (; asked_ < want; asked_++) __builtin_prefetch(out_.first + asked_ * out_.stride, 1, 3);
    }

private:
    OutputLines out_;
    int64_t rows_, steps_, step_ = 0, asked_ = 0;
};

#if defined(PARROT_AMX)
// The calling thread's tiles for passes of `rows` (1-32) rows: 0-1 the sums of the first 16 rows (or fewer),
// 2-3 of the rest, 4-5 those rows of input, 6-7 a block's two halves of 16 features.
void configure_row_tiles(int64_t rows) {
    const uint8_t first = rows < 16 ? rows : 16, second = rows - first;
    configure_tiles({first, first, second, second, first, second, 16, 16});
}

// sums [rows][32 features] (kBlockCols apart) of x's `rows` rows (row stride in_features) against one packed
// block, the tiles configured for `rows`.
// `between(step, steps)` runs after each step's tile instructions are issued: vector work that overlaps the tiles'.
template <typename Between>
void tile_block(const uint16_t *block, const uint16_t *x, int64_t rows, int64_t in_features, Pass pass, float *sums,
                OutputLines out, Between &between) {
    const int64_t row_bytes = in_features * 2, step_bytes = 2 * kBlockCols * 2, sum_bytes = kBlockCols * 4;
    NextBlockPrefetch prefetch(block + kBlockCols * in_features, kTileInputs * kBlockCols * 2, pass);
    OutputPrefetch out_prefetch(out, rows, in_features / kTileInputs);
    _tile_zero(0);
    _tile_zero(1);
    if (rows > 16) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < in_features; k += kTileInputs) {
        const uint16_t *weights = block + k * kBlockCols;  // pair step k / 2: 2 * kBlockCols values a step
        prefetch.step();
        out_prefetch.step();
        _tile_loadd(4, x + k, row_bytes);
        _tile_loadd(6, weights, step_bytes);
        _tile_loadd(7, weights + kLanes * 2, step_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows > 16) {
            _tile_loadd(5, x + 16 * in_features + k, row_bytes);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        between(k / kTileInputs, in_features / kTileInputs);
    }
    _tile_stored(0, sums, sum_bytes);
    _tile_stored(1, sums + kLanes, sum_bytes);
    if (rows > 16) {
        _tile_stored(2, sums + 16 * kBlockCols, sum_bytes);
        _tile_stored(3, sums + 16 * kBlockCols + kLanes, sum_bytes);
    }
}
#else
void configure_row_tiles(int64_t) {}
template <typename Between>
void tile_block(const uint16_t *, const uint16_t *, int64_t, int64_t, Pass, float *, OutputLines, Between &) {}
#endif

// Whether rows of this dtype and width go through tiles here.
template <typename T>
bool tiles_take(int64_t in_features) {
    return std::is_same<T, uint16_t>::value && in_features % kTileInputs == 0 && tiles_usable();
}

// No work between a tile pass's steps.
struct NothingBetween {
    void operator()(int64_t, int64_t) const {}
};

// A tile pass's sums [rows][kBlockCols] of one block, where tiles_take<T>() (never called otherwise); `out` and
// `between` as tile_block's.
template <typename T, typename Between = NothingBetween>
void tile_sums(const T *block, const T *x, int64_t rows, int64_t in_features, Pass pass, float *sums,
               OutputLines out = {}, Between &&between = {}) {
    if constexpr (std::is_same<T, uint16_t>::value) tile_block(block, x, rows, in_features, pass, sums, out, between);
}

// One thread's band of a call's work items, claimed one at a time: by its thread from the front, in order (within
// a chunk, the next block a pass prefetches is the one it takes next), and once another thread's own band is
// empty, by that thread from the back (the band's last chunk, which its owner would reach last). Bands split
// evenly and kept (static) left one thread waiting for the other whenever their vCPUs ran at different speeds,
// which on this host (a Firecracker guest) is often: its two vCPUs ran a
// layer's 1,024-row bf16 linears alone at 336 and 747 GFLOP/s in the same minute, and a perf trace of compiled
// prefill steps found a thread waiting at the end of a parallel region ~30% of its time, mostly while the other
// was not running at all (preempted by the host). Kernel A/B (benchmarks.kernel_revisions): a layer's linears
// at 1,024 rows 0.79x and 0.88x the time in two runs (0.64x in a minute when one vCPU was slow), 112 rows
// 0.84x and 1.00x, 1-16 rows level (0.97-1.02x). Front and back share one atomic word (32 bits each: a call
// has at most a few million items, its chunks of rows x outputs / 32), so a claim is one successful
// compare-exchange and never hands out an item twice.
class alignas(64) Band {
public:
    void reset(int64_t first, int64_t last) { range_.store(pack(first, last), std::memory_order_relaxed); }

    bool take_front(int64_t &item) { return take(item, true); }
    bool take_back(int64_t &item) { return take(item, false); }

private:
    static uint64_t pack(int64_t first, int64_t last) { return static_cast<uint64_t>(first) << 32 | static_cast<uint64_t>(last); }

    bool take(int64_t &item, bool front) {
        uint64_t range = range_.load(std::memory_order_relaxed);
        for (;;) {
            const int64_t first = static_cast<int64_t>(range >> 32), last = static_cast<int64_t>(range & 0xffffffffu);
            if (first >= last) return false;
            item = front ? first : last - 1;
            const uint64_t rest = front ? pack(first + 1, last) : pack(first, last - 1);
            if (range_.compare_exchange_weak(range, rest, std::memory_order_relaxed)) return true;
        }
    }

    std::atomic<uint64_t> range_{0};
};

// How a call's rows go in passes over each unit: chunks of rows, each chunk's passes over a unit one work item.
// Tiled: chunks of kChunkRows (their input stays in cache while a band of units passes over them) in passes of
// 32 rows, then one chunk of the rest, in tiles configured to its count; else chunks of kVectorChunkBytes of input
// in passes of equal size up to kMaxRows (on AVX-512, 16 rows: two of 8), each over a unit while it is in cache.
struct RowPlan {
    int64_t rows, whole_pass_rows, chunks;
    bool tiled;

    RowPlan(int64_t rows, bool tiled, int64_t row_bytes)
        : rows(rows), whole_pass_rows(tiled ? rows / kTileRows * kTileRows : 0),
          chunks(tiled ? (whole_pass_rows + kChunkRows - 1) / kChunkRows + (rows > whole_pass_rows)
                       : vector_chunks(rows, row_bytes)),
          tiled(tiled) {}

    // Chunks of at most kVectorChunkBytes of input, each at least a pass of kMaxRows rows (one for no input).
    static int64_t vector_chunks(int64_t rows, int64_t row_bytes) {
        const int64_t by_bytes = (rows * row_bytes + kVectorChunkBytes - 1) / kVectorChunkBytes;
        return std::max<int64_t>(rows > 0, std::min(by_bytes, (rows + kMaxRows - 1) / kMaxRows));
    }

    // g(row, end, pass) for each pass of a vector chunk: equal chunks, in passes of equal size up to kMaxRows.
    template <typename G>
    void vector_passes(int64_t chunk, G &&g) const {
        const int64_t first = rows * chunk / chunks, count = rows * (chunk + 1) / chunks - first;
        const int64_t passes = (count + kMaxRows - 1) / kMaxRows;
        for (int64_t p = 0; p < passes; p++) g(first + count * p / passes, first + count * (p + 1) / passes, Pass{p, passes});
    }

    // f(unit, row, end, pass) for each pass of `chunk` over `unit`; `configured`: the rows the calling thread's
    // tiles are set up for (0: none yet).
    template <typename F>
    void run(int64_t chunk, int64_t unit, int64_t &configured, F &f) const {
        if (!tiled) return vector_passes(chunk, [&](int64_t row, int64_t end, Pass pass) { f(unit, row, end, pass); });
        const int64_t first = chunk * kChunkRows, whole = whole_pass_rows;
        if (first >= whole) {  // the rest, fewer than a pass
            if (configured != rows - whole) configure_row_tiles(configured = rows - whole);
            return f(unit, whole, rows, Pass{0, 1});
        }
        if (configured != kTileRows) configure_row_tiles(configured = kTileRows);
        const int64_t passes = (std::min(whole, first + kChunkRows) - first) / kTileRows;
        for (int64_t p = 0; p < passes; p++) f(unit, first + p * kTileRows, first + (p + 1) * kTileRows, Pass{p, passes});
    }
};

// f(unit, row, end, pass) over each of `units` units of the weight (a block, or a gate block and its up block)
// and each pass of rows (RowPlan), on the calling OpenMP team. Each thread has a contiguous band of units and
// takes its items chunk by chunk, each chunk's units in order, streaming its part of the weight; a thread whose
// band is done takes the last items of the following threads' bands in turn (Band). A band whose thread the
// team lacks (OpenMP may give fewer threads than asked) is taken from the front, in its owner's order.
template <typename F>
void for_each_unit(int64_t units, const RowPlan &plan, int num_threads, F f) {
    constexpr int kStackBands = 16;  // a decode step makes ~120 calls: no allocation for the usual thread counts
    if (!plan.chunks || !units) return;
    const int bands_count = std::max(num_threads, 1);
    const auto first_unit = [&](int band) { return units * band / bands_count; };
    Band stack_bands[kStackBands];
    const std::unique_ptr<Band[]> heap_bands(bands_count > kStackBands ? new Band[bands_count] : nullptr);
    Band *const bands = heap_bands ? heap_bands.get() : stack_bands;
    for (int b = 0; b < bands_count; b++) bands[b].reset(0, plan.chunks * (first_unit(b + 1) - first_unit(b)));
#pragma omp parallel num_threads(bands_count)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        int64_t configured = 0, claimed;
        const auto run_item = [&](int band, int64_t item) {
            const int64_t width = first_unit(band + 1) - first_unit(band);
            plan.run(item / width, first_unit(band) + item % width, configured, f);
        };
        while (bands[thread].take_front(claimed)) run_item(thread, claimed);
        for (int other = 1; other < bands_count; other++) {
            const int band = (thread + other) % bands_count;
            if (band >= team)
                while (bands[band].take_front(claimed)) run_item(band, claimed);
            while (bands[band].take_back(claimed)) run_item(band, claimed);
        }
        if (configured) release_tiles();  // a thread holding tile state costs every context switch 8 KB more
    }
}

// The vector passes read a call's input interleaved from this many rows on: prefill chunks, on AVX-512, where it
// was measured. 1-16 rows (a batched decode step: one pass of up to 12 rows, or two of 7-8) are read in place, as
// before interleaving existed; they were not measured interleaved. AVX2's passes (up to 6 rows) keep their few
// pointers in registers, and it was not measured there either.
#if defined(__AVX512F__)
constexpr int64_t kInterleavedRows = 17;
#else
constexpr int64_t kInterleavedRows = INT64_MAX;
#endif

// A 32-bit element (an fp32 value, or a pair of bf16 inputs) read and written through any type's storage.
typedef uint32_t Element __attribute__((may_alias));

// `rows` (at most kLanes) rows of x, [rows][steps] elements, laid out step by step, [steps][rows], at `to`: kLanes
// steps at a time transposed in registers (common.h), the first `rows` lanes of each stored. Element by element
// it took ~0.85 cycles an element, ~5% of a 1,024-row fp32 down projection's time.
inline void interleave(const Element *x, int64_t rows, int64_t steps, Element *to) {
    int64_t s = 0;
#if defined(__AVX512F__)
    const __mmask16 first_rows = static_cast<__mmask16>((1u << rows) - 1);
    for (; s + kLanes <= steps; s += kLanes) {
        __m512i lanes[kLanes];
        for (int r = 0; r < kLanes; r++) lanes[r] = r < rows ? _mm512_loadu_si512(x + r * steps + s) : _mm512_setzero_si512();
        transpose_lanes(lanes);
        for (int c = 0; c < kLanes; c++) _mm512_mask_storeu_epi32(to + (s + c) * rows, first_rows, lanes[c]);
    }
#endif
    for (; s < steps; s++)
        for (int64_t r = 0; r < rows; r++) to[s * rows + r] = x[r * steps + s];
}

// The calling thread's buffer for a call's rows as its passes read them (interleaved, widened, or quantized to int8
// with their steps and sums: a call takes one of these, and calls do not nest on a thread), at least `count` elements; kept for the thread's next calls, grown as
// they need.
template <typename U>
U *calling_thread_rows(int64_t count) {
    static thread_local std::unique_ptr<U[]> buffer;
    static thread_local int64_t capacity = 0;
    if (count > capacity) {
        buffer.reset();  // the old one freed first; capacity recorded once the new one exists
        buffer.reset(new U[count]);
        capacity = count;
    }
    return buffer.get();
}

// x's rows as the vector passes read them from kInterleavedRows on: each pass's rows interleaved (interleave) where
// the pass's first row would be, in a buffer the calling thread keeps for its next calls (as large as its largest
// call's input: 12.6 MB for a 2,048-token fp32 prefill step's 1,536-wide down projection). Read in place, a pass of
// 12 rows kept 12 row pointers, more than the general registers left free: the compiler moved some through vector
// registers and the stack every step, on a multiply-add port; interleaved, a step's broadcasts are one line
// through one pointer. Kernel A/B with ask_for_output below (benchmarks.kernel_revisions, fp32, 40 rounds a load
// order, docs/benchmarks/kernel_revisions_interleaved_rows_fp32.json): a layer's linears 0.92x the time at 1,024
// rows and 0.94x at 112, the gated one alone 0.91x and 0.90x, 1-16 rows and attention level (0.98-1.01x). bf16
// rows without tiles (this host with its tiles off; one process, alternating builds): 0.96-0.98x at 1,024 rows.
template <typename T>
const T *interleaved_rows(const T *x, const RowPlan &plan, int64_t in_features, int num_threads) {
    static_assert(sizeof(T) * Ops<T>::kPack == sizeof(Element) && kMaxRows <= kLanes, "a pass's step is a vector");
    T *const to = calling_thread_rows<T>(plan.rows * in_features);
    // Every pass its own item, so that a call of one chunk (up to 512 KB of input) spreads over the threads too.
    std::vector<std::pair<int64_t, int64_t>> passes;
    for (int64_t chunk = 0; chunk < plan.chunks; chunk++)
        plan.vector_passes(chunk, [&](int64_t row, int64_t end, Pass) { passes.emplace_back(row, end); });
#pragma omp parallel for num_threads(std::max(num_threads, 1)) schedule(static)
    for (size_t p = 0; p < passes.size(); p++) {
        const auto [row, end] = passes[p];
        interleave(reinterpret_cast<const Element *>(x + row * in_features), end - row, in_features / Ops<T>::kPack,
                   reinterpret_cast<Element *>(to + row * in_features));
    }
    return to;
}

// A vector pass's lines of output (`rows` rows of a block's kBlockCols features, `stride` elements apart) asked
// into L1 before its multiply-adds: a prefill's output (4 MB for a 1,024-row fp32 QKV) is mostly out of the caches
// when the allocator hands it out, and the pass's stores then waited on their lines' reads. SmolLM2's 1,024-row
// fp32 QKV and o linears took 0.82-0.88x the time with this beside interleaving alone (the down projection
// 0.93-1.0x; one core and two, alternating builds in one process).
template <typename T>
void ask_for_output(const T *first, int64_t stride, int64_t rows) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t byte = 0; byte < kBlockCols * static_cast<int64_t>(sizeof(T)); byte += 64)
            __builtin_prefetch(reinterpret_cast<const char *>(first + r * stride) + byte, 1, 3);
}

#if defined(PARROT_WIDENED_BF16)
// A call's bf16 rows as fp32 (`count` values), in the calling thread's buffer (calling_thread_rows).
inline const float *widened_rows(const uint16_t *x, int64_t count, int num_threads) {
    float *const to = calling_thread_rows<float>(count);
    const int64_t vectors = count / kLanes;
    // A decode step's few rows (a few thousand values) in one thread: a parallel region costs more than they do.
#pragma omp parallel for num_threads(std::max(num_threads, 1)) schedule(static) if (vectors > (1 << 14))
    for (int64_t i = 0; i < vectors; i++) save(to + i * kLanes, Ops<uint16_t>::widened(x + i * kLanes));
    for (int64_t i = vectors * kLanes; i < count; i++) to[i] = bf16_to_float(x[i]);
    return to;
}
#endif

// How a call reads its rows: through tiles, or in vector passes over the rows in place, interleaved or widened to
// fp32 (`input`: x, or its interleaved or widened copy), chunked by `plan`.
template <typename T>
struct CallRows {
    using Input = typename Ops<T>::Input;
    bool tiled, interleaved;
    RowPlan plan;
    const Input *input;

    CallRows(const T *x, int64_t rows, int64_t in_features, int num_threads)
        : tiled(tiles_take<T>(in_features)), interleaved(!tiled && std::is_same<Input, T>::value && rows >= kInterleavedRows),
          plan(rows, tiled, in_features * sizeof(Input)), input(rows_as_read(x, rows, in_features, num_threads)) {}

    // The vector pass over `count` rows from `row` against one block's `weights`, its sums to `sink`.
    template <typename Sink>
    void vector_pass(const T *weights, int64_t row, int64_t count, int64_t in_features, Pass pass, Sink sink) const {
        block_rows_for<T, Sink>(count, interleaved)(weights, input + row * in_features, in_features, pass, sink);
    }

private:
    const Input *rows_as_read(const T *x, int64_t rows, int64_t in_features, int num_threads) const {
        if constexpr (!std::is_same<Input, T>::value) {
#if defined(PARROT_WIDENED_BF16)
            return widened_rows(x, rows * in_features, num_threads);
#endif
        } else {
            return interleaved ? interleaved_rows(x, plan, in_features, num_threads) : x;
        }
    }
};

// Whether the kernel takes these sizes: whole input steps and whole blocks of output features.
template <typename T>
bool sizes_fit(int64_t rows, int64_t out_features, int64_t in_features) {
    return in_features % Ops<T>::kPack == 0 && out_features % kBlockCols == 0 && rows >= 0;
}

template <typename T>
int linear(const T *x, const T *weight, const T *bias, T *out, int64_t rows, int64_t out_features,
           int64_t in_features, int num_threads) {
    if (!sizes_fit<T>(rows, out_features, in_features)) return -1;
    const CallRows<T> call(x, rows, in_features, num_threads);
    for_each_unit(out_features / kBlockCols, call.plan, num_threads, [&](int64_t block, int64_t row, int64_t end, Pass pass) {
        const int64_t feature = block * kBlockCols;
        const T *weights = weight + feature * in_features;
        const Output<T> sink{out + row * out_features + feature, out_features, bias ? bias + feature : nullptr};
        if (!call.tiled) {
            if (call.interleaved) ask_for_output(sink.out, out_features, end - row);
            return call.vector_pass(weights, row, end - row, in_features, pass, sink);
        }
        alignas(64) float sums[kTileRows * kBlockCols];
        const OutputLines out_lines = OutputLines::of(sink.out, out_features);
        tile_sums(weights, x + row * in_features, end - row, in_features, pass, sums, out_lines);
        sink.from_sums(sums, end - row);
    });
    return 0;
}

// silu(g) = g / (1 + exp(-g)) lane by lane; exp(-g) clamped to its fp32 range (past 88 it would be inf, and
// silu(g) is then -0, as g / inf).
inline Vec silu(Vec g) {
    const Vec minus_g = -g;
    return g / (exp_in_range(minus_g > 88.0f ? Vec{} + 88.0f : minus_g < -87.0f ? Vec{} - 87.0f : minus_g) + 1.0f);
}

// silu(gate) * up for `out_features` outputs from a weight of 2 x out_features packed blocks, gate and up
// alternating (see the top of this file).
template <typename T>
int gated_linear(const T *x, const T *weight, T *out, int64_t rows, int64_t out_features, int64_t in_features,
                 int num_threads) {
    using O = Ops<T>;
    if (!sizes_fit<T>(rows, out_features, in_features)) return -1;
    const CallRows<T> call(x, rows, in_features, num_threads);
    for_each_unit(out_features / kBlockCols, call.plan, num_threads, [&](int64_t block, int64_t row, int64_t end, Pass pass) {
        const T *gate = weight + 2 * block * kBlockCols * in_features, *up = gate + kBlockCols * in_features;
        alignas(64) float gates[kTileRows * kBlockCols], ups[kTileRows * kBlockCols];
        const int64_t count = end - row;
        int64_t activated = 0;  // rows of gates holding silu(gate) as the dtype rounds it
        const auto activate_rows = [&](int64_t upto) {
            for (; activated < upto; activated++)
                for (int64_t c = 0; c < kBlockCols; c += kLanes) {
                    float *g = gates + activated * kBlockCols + c;
                    save(g, O::rounded(silu(O::rounded(load(g)))));
                }
        };
        if (call.tiled) {
            tile_sums(gate, x + row * in_features, count, in_features, pass, gates);
            // The gates' silu on the vector units while the up's tiles compute, a few rows a step: after them it
            // held the next pass's tiles back. Kernel A/B (benchmarks.kernel_revisions, bf16, 60-100 rounds a load
            // order, three runs; docs/benchmarks/kernel_revisions_gated_overlap_bf16.json): the gated linear alone
            // 0.90x the time at 16 rows, 0.88-0.89x at 112, 0.935-0.96x at 1,024; a layer's linears 0.96x, 0.94-0.97x
            // and 0.98-1.0x, the unchanged attention 0.97-1.05x in the same runs.
            tile_sums(up, x + row * in_features, count, in_features, pass, ups, {},
                      [&](int64_t step, int64_t steps) { activate_rows((step + 1) * count / steps); });
        } else {
            if (call.interleaved) ask_for_output(out + row * out_features + block * kBlockCols, out_features, count);
            call.vector_pass(gate, row, count, in_features, pass, Sums<T>{gates});
            call.vector_pass(up, row, count, in_features, pass, Sums<T>{ups});
        }
        activate_rows(count);
        for (int64_t r = 0; r < count; r++)
            for (int64_t c = 0; c < kBlockCols; c += kLanes)
                O::store(out + (row + r) * out_features + block * kBlockCols + c,
                         load(gates + r * kBlockCols + c) * O::rounded(load(ups + r * kBlockCols + c)));
    });
    return 0;
}


// ---- Group-quantized weights: a linear whose [N, K] weight is integer codes in groups of 32 inputs, each group and
// feature with its own fp16 scale: GGUF's Q4_1 (codes 0-15 and a minimum: weight = code * scale + minimum, the
// default model's format) and Q8_0 (codes -127..127: weight = code * scale, the format GGUF keeps its output heads
// in) ----
// Why: torch's int4 kernel (_weight_int4pack_mm_for_cpu) is compute-bound on an AVX2 CPU: a batch-1 step of
// SmolLM2's linears took 17-18 ms for ~53 MB of 4-bit weights, fp32's time, and one stream decoded at 0.85x
// llama.cpp's. A first kernel of ours widened each step's codes to fp32 and multiplied them by fp32 rows
// (0.41-0.53x torch's time from 1 to 256 rows); it was bound by its ~7 vector instructions per 16 weights (~4
// weights a cycle a core with the weights in L2), and one stream decoded at 1.02x llama.cpp's. So here, as
// llama.cpp does, each row is quantized once a call to int8 per group of 32 inputs (a step of its largest |x| /
// 127, rounded to nearest even), and a group's products are integer: 4 inputs' codes x 8 features in one register,
// multiplied and summed in pairs (vpmaddubsw, whose first operand is unsigned: Q4_1's codes as they are, Q8_0's
// signed codes against |x| with x's signs moved onto them, at most 2 x 127 x 127 so no saturation) and pairs of
// pairs (vpmaddwd), ~10 instructions per 64 weights and a row at 4 bits. Each group's integer sums then take the
// group's scale times the row's step, plus for Q4_1 its minimum times the row's exact (fp32) sum of the group's
// inputs: sum(w x) = scale sum(code x) + minimum sum(x). The weights stream as GGUF stores them: 5 bits a weight
// for Q4_1, 8.5 for Q8_0. SmolLM2's 30 layers' linears took 0.73-0.82x the first 4-bit kernel's time from 1 to 256
// rows (alternating in one process, an AMD EPYC); the rows' int8 adds ~1% relative error to a product, 4-bit
// weights ~10%, 8-bit ones ~0.5%. AVX2 (256-bit) and F16C instructions, also on AVX-512 CPUs; elsewhere the caller
// keeps torch's kernels.
//
// Layout (parrot_pack_q4, parrot_pack_q8): for each block of kBlockCols features, its two parts of 16 one after
// the other; a part is its groups in input order, a group is the format's header (16 fp16 scales; for Q4_1 then
// 16 fp16 minimums), then 8 quads of 4 inputs: byte 4j + p of a quad holds the code for the quad's input p of the
// part's feature j (Q8_0: 32 bytes for features 0-7, then 32 for 8-15), or for Q4_1 (32 bytes) of feature j in its
// low nibble and of feature 8 + j in its high one. So each pass reads one sequential stream.
constexpr int64_t kGroupPartCols = 16;  // a part's sums: two vectors of 8 32-bit lanes
constexpr int64_t kGroupParts = kBlockCols / kGroupPartCols;
constexpr int64_t kGroupQuads = kGroupInputs / 4;

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PARROT_GROUPED 1

// A call's rows as the passes read them: int8 codes [rows][K], and per row and group of 32 inputs its step (the
// codes' unit) and the exact sum of its inputs, [rows][groups].
struct GroupedRows {
    const int8_t *codes;
    const float *steps, *sums;
    int64_t in_features, groups;

    GroupedRows from(int64_t row) const {
        return {codes + row * in_features, steps + row * groups, sums + row * groups, in_features, groups};
    }
};

// One group of 32 inputs to int8 codes of step max|x| / 127 (0 for a group of zeros), and the inputs' sum.
inline void quantize_group(const float *x, int8_t *codes, float &step, float &sum) {
    Vec largest{}, total{};
    for (int64_t i = 0; i < kGroupInputs; i += kLanes) {
        const Vec v = load(x + i);
        const Vec magnitude = (Vec)((IntVec)v & 0x7fffffff);
        largest = magnitude > largest ? magnitude : largest;
        total += v;
    }
    const float most = max_lanes(largest);
    step = most / 127.0f;
    sum = sum_lanes(total);
    const __m256 inverse = _mm256_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), inverse));  // nearest even
    // packs work within 128-bit halves: the 32-bit groups of 4 codes come out as 0, 2, 4, 6, 1, 3, 5, 7
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(codes), ordered);
}

// x's rows quantized (quantize_group) into the calling thread's buffers (calling_thread_rows).
inline GroupedRows quantized_rows(const float *x, int64_t rows, int64_t in_features, int num_threads) {
    const int64_t groups = in_features / kGroupInputs, count = rows * groups;
    int8_t *const to = calling_thread_rows<int8_t>(rows * in_features);
    float *const steps = calling_thread_rows<float>(2 * count), *const sums = steps + count;
    // A decode step's few rows in one thread: a parallel region costs more than they do.
#pragma omp parallel for num_threads(std::max(num_threads, 1)) schedule(static) if (count > 4096)
    for (int64_t i = 0; i < count; i++) quantize_group(x + i * kGroupInputs, to + i * kGroupInputs, steps[i], sums[i]);
    return {to, steps, sums, in_features, groups};
}

inline __m256 widened_halves(const uint8_t *from) {  // 8 fp16 values
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(from)));
}

// A group format: its bytes; a quad's codes as two vectors of 8 features x 4 inputs (codes); pairs of their products
// with a row's 4 int8 inputs, `input` in every 32-bit lane, summed in 16-bit lanes (pair_products); a group's scales
// widened once (Scales), which scale its integer sums `dots` (vector v of the part) into a row's totals; and how the
// packer writes a feature j's code and feature 8 + j's for one input at their place in a quad (pack_codes).
struct Q4_1 {  // 16 fp16 scales, 16 fp16 minimums, quads of nibbles
    static constexpr int64_t kHeaderBytes = 2 * kGroupPartCols * 2, kQuadBytes = 32;
    static constexpr int64_t kGroupBytes = kHeaderBytes + kGroupQuads * kQuadBytes;
    static constexpr int64_t kBlockBytesPerInput = kQ4BlockBytesPerInput;  // c_api.h's
    static constexpr bool kMinimums = true;

    static void codes(const uint8_t *quad, __m256i (&codes)[2]) {
        const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(quad));
        codes[0] = _mm256_and_si256(packed, low_nibbles);
        codes[1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
    }

    static __m256i pair_products(__m256i codes, __m256i input) { return _mm256_maddubs_epi16(codes, input); }

    // sum(w x) = scale step sum(code x') + minimum sum(x), x' the row's int8 inputs and sum(x) its exact one.
    struct Scales {
        __m256 scale[2], minimum[2];

        explicit Scales(const uint8_t *group)
            : scale{widened_halves(group), widened_halves(group + 16)},
              minimum{widened_halves(group + 32), widened_halves(group + 48)} {}

        __m256 scaled(int v, __m256i dots, __m256 step, __m256 sum, __m256 total) const {
            return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale[v], step),
                                   _mm256_fmadd_ps(minimum[v], sum, total));
        }
    };

    static void pack_codes(uint8_t *quad, uint8_t low, uint8_t high) {
        quad[0] = static_cast<uint8_t>((low & 15) | (high & 15) << 4);
    }
};

struct Q8_0 {  // 16 fp16 scales, quads of bytes: 32 for features 0-7, then 32 for 8-15
    static constexpr int64_t kHeaderBytes = kGroupPartCols * 2, kQuadBytes = 64;
    static constexpr int64_t kGroupBytes = kHeaderBytes + kGroupQuads * kQuadBytes;
    static constexpr int64_t kBlockBytesPerInput = kQ8BlockBytesPerInput;  // c_api.h's
    static constexpr bool kMinimums = false;

    static void codes(const uint8_t *quad, __m256i (&codes)[2]) {
        for (int v = 0; v < 2; v++) codes[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(quad + 32 * v));
    }

    // vpmaddubsw's first operand is unsigned: |x| against the codes with x's signs moved onto them.
    static __m256i pair_products(__m256i codes, __m256i input) {
        return _mm256_maddubs_epi16(_mm256_abs_epi8(input), _mm256_sign_epi8(codes, input));
    }

    struct Scales {
        __m256 scale[2];

        explicit Scales(const uint8_t *group) : scale{widened_halves(group), widened_halves(group + 16)} {}

        __m256 scaled(int v, __m256i dots, __m256 step, __m256, __m256 total) const {
            return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale[v], step), total);
        }
    };

    static void pack_codes(uint8_t *quad, uint8_t low, uint8_t high) {
        quad[0] = low;
        quad[32] = high;
    }
};
template <typename Format>
constexpr bool blocks_as_declared = Format::kGroupBytes * kGroupParts == Format::kBlockBytesPerInput * kGroupInputs;
static_assert(blocks_as_declared<Q4_1> && blocks_as_declared<Q8_0>, "c_api.h's bytes per input");

// How far ahead of its group a pass asks for its stream (8 of Q4_1's groups: the part's, or past its end the bytes
// that follow, mostly the block the thread takes next; past the weight harmless), non-temporally. The hardware's
// prefetchers alone left the integer products waiting: 30 layers' 4-bit linears streamed at ~12 GB/s at 1 row, ~19
// with the weights in L2. With these requests 0.79-0.98x the time at 1-4 rows, 0.94-1.06x at 16 and 0.98-1.06x at
// 256 (three alternating runs in one process; T0 requests and 1,280 or 5,120 bytes ahead streamed slower at 1 row).
// The same bytes ahead for Q8_0 (~4.7 of its groups): 8 of its groups or 5,120 bytes took 0.98-1.06x the time at 1-64
// rows (one run, alternating).
constexpr int64_t kGroupAheadBytes = 8 * Q4_1::kGroupBytes;

// Rows x one block's group-quantized weights, their fp32 sums to sums [rows][kBlockCols].
template <typename Format, int rows>
void grouped_block_rows(const uint8_t *block, const GroupedRows &x, float *sums) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int part = 0; part < kGroupParts; part++) {
        const uint8_t *group = block + part * x.groups * Format::kGroupBytes;
        __m256 totals[rows][2];
        for (int r = 0; r < rows; r++) totals[r][0] = totals[r][1] = _mm256_setzero_ps();
        for (int64_t g = 0; g < x.groups; g++, group += Format::kGroupBytes) {
            const uint8_t *quads = group + Format::kHeaderBytes;
            for (int64_t line = 0; line < Format::kGroupBytes; line += 64)
                __builtin_prefetch(group + kGroupAheadBytes + line, 0, 0);
            __m256i dots[rows][2];
            for (int r = 0; r < rows; r++) dots[r][0] = dots[r][1] = _mm256_setzero_si256();
            for (int q = 0; q < kGroupQuads; q++) {
                __m256i codes[2];
                Format::codes(quads + q * Format::kQuadBytes, codes);
                for (int r = 0; r < rows; r++) {
                    int32_t quad;  // the row's 4 int8 inputs
                    std::memcpy(&quad, x.codes + r * x.in_features + g * kGroupInputs + 4 * q, sizeof quad);
                    const __m256i input = _mm256_set1_epi32(quad);
                    for (int v = 0; v < 2; v++)
                        dots[r][v] = _mm256_add_epi32(dots[r][v], _mm256_madd_epi16(Format::pair_products(codes[v], input), ones));
                }
            }
            const typename Format::Scales scales(group);
            for (int r = 0; r < rows; r++) {
                const __m256 step = _mm256_set1_ps(x.steps[r * x.groups + g]), sum = _mm256_set1_ps(x.sums[r * x.groups + g]);
                for (int v = 0; v < 2; v++) totals[r][v] = scales.scaled(v, dots[r][v], step, sum, totals[r][v]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < 2; v++) _mm256_storeu_ps(sums + r * kBlockCols + part * kGroupPartCols + v * 8, totals[r][v]);
    }
}

// A pass takes the plan's rows (RowPlan: up to 6 on AVX2, 12 on AVX-512) at once, its sums in registers beside a
// quad's two vectors of codes, the ones and a row's input: on AVX2's 16 registers 6 rows of Q4_1 leave one vector
// (its mask) to the stack, and took 0.88-0.99x the time of passes of 5 rows and 1 (SmolLM2's 30 layers' linears at
// 16-256 rows, two runs alternating in one process; level at 1 and 6 rows). Picked by instance_for_rows.
template <typename Format>
int grouped_linear(const float *x, const uint8_t *weight, const float *bias, float *out, int64_t rows,
                   int64_t out_features, int64_t in_features, int num_threads) {
    if (in_features % kGroupInputs || out_features % kBlockCols || rows < 0) return -1;
    const GroupedRows quantized = quantized_rows(x, rows, in_features, num_threads);
    const RowPlan plan(rows, false, in_features);
    const int64_t block_bytes = Format::kBlockBytesPerInput * in_features;
    for_each_unit(out_features / kBlockCols, plan, num_threads, [&](int64_t block, int64_t row, int64_t end, Pass) {
        alignas(64) float sums[kMaxRows * kBlockCols];
        instance_for_rows(end - row, [](auto rows) { return grouped_block_rows<Format, rows.value>; })(
            weight + block * block_bytes, quantized.from(row), sums);
        const int64_t feature = block * kBlockCols;
        Output<float>{out + row * out_features + feature, out_features, bias ? bias + feature : nullptr}.from_sums(sums, end - row);
    });
    return 0;
}

// The packed layout above from codes [N][K] (Q4_1: 0-15; Q8_0: -127..127), scales [N][K/32] and for Q4_1 minimums
// [N][K/32] (each to fp16, nearest).
template <typename Format>
int pack_grouped(const uint8_t *codes, const float *scales, const float *minimums, uint8_t *packed,
                 int64_t out_features, int64_t in_features) {
    if (in_features % kGroupInputs || out_features % kBlockCols) return -1;
    const int64_t groups = in_features / kGroupInputs;
    for (int64_t block = 0; block < out_features / kBlockCols; block++)
        for (int64_t part = 0; part < kGroupParts; part++)
            for (int64_t g = 0; g < groups; g++) {
                uint8_t *group = packed + ((block * kGroupParts + part) * groups + g) * Format::kGroupBytes;
                uint16_t *halves = reinterpret_cast<uint16_t *>(group);
                const int64_t first = block * kBlockCols + part * kGroupPartCols;
                for (int64_t f = 0; f < kGroupPartCols; f++) {
                    halves[f] = _cvtss_sh(scales[(first + f) * groups + g], _MM_FROUND_TO_NEAREST_INT);
                    if constexpr (Format::kMinimums)
                        halves[kGroupPartCols + f] = _cvtss_sh(minimums[(first + f) * groups + g], _MM_FROUND_TO_NEAREST_INT);
                }
                uint8_t *quads = group + Format::kHeaderBytes;
                for (int64_t i = 0; i < kGroupInputs; i++)
                    for (int64_t j = 0; j < 8; j++) {
                        const int64_t k = g * kGroupInputs + i;
                        Format::pack_codes(quads + i / 4 * Format::kQuadBytes + 4 * j + i % 4,
                                           codes[(first + j) * in_features + k], codes[(first + 8 + j) * in_features + k]);
                    }
            }
    return 0;
}
#endif

}  // namespace

extern "C" {

int parrot_linear_f32(const float *x, const float *weight, const float *bias, float *out, int64_t rows,
                      int64_t out_features, int64_t in_features, int num_threads) {
    return linear<float>(x, weight, bias, out, rows, out_features, in_features, num_threads);
}

int parrot_gated_linear_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t out_features,
                            int64_t in_features, int num_threads) {
    return gated_linear<float>(x, weight, out, rows, out_features, in_features, num_threads);
}

// -2 where this build has no bf16 path: no bf16 dot product, and not an AVX2 build (the widened path stays off
// AVX-512 CPUs without BF16, where it was not measured against oneDNN's bf16): the caller keeps torch's path.
int parrot_linear_bf16(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, uint16_t *out, int64_t rows,
                       int64_t out_features, int64_t in_features, int num_threads) {
#if defined(__AVX512BF16__) || defined(PARROT_WIDENED_BF16)
    return linear<uint16_t>(x, weight, bias, out, rows, out_features, in_features, num_threads);
#else
    (void)x, (void)weight, (void)bias, (void)out, (void)rows, (void)out_features, (void)in_features, (void)num_threads;
    return -2;
#endif
}

int parrot_gated_linear_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                             int64_t out_features, int64_t in_features, int num_threads) {
#if defined(__AVX512BF16__) || defined(PARROT_WIDENED_BF16)
    return gated_linear<uint16_t>(x, weight, out, rows, out_features, in_features, num_threads);
#else
    (void)x, (void)weight, (void)out, (void)rows, (void)out_features, (void)in_features, (void)num_threads;
    return -2;
#endif
}

// Whether bf16 linears and attention go through AMX tiles from now on (1) or the vector paths only (0), for
// comparing the two; answers whether tiles are used.
int parrot_use_tiles(int enable) {
    tiles_enabled() = enable != 0;
    return tiles_usable();
}

// -2 where this build has no group-quantized kernels (not AVX2): the caller keeps torch's kernels.
#if defined(PARROT_GROUPED)
#define PARROT_GROUPED_ENTRIES(FORMAT, LINEAR, PACK)                                                                \
    int LINEAR(const float *x, const uint8_t *weight, const float *bias, float *out, int64_t rows,                  \
               int64_t out_features, int64_t in_features, int num_threads) {                                        \
        return grouped_linear<FORMAT>(x, weight, bias, out, rows, out_features, in_features, num_threads);          \
    }                                                                                                               \
    int PACK(const uint8_t *codes, const float *scales, const float *minimums, uint8_t *packed,                     \
             int64_t out_features, int64_t in_features) {                                                           \
        return pack_grouped<FORMAT>(codes, scales, minimums, packed, out_features, in_features);                    \
    }
#else
#define PARROT_GROUPED_ENTRIES(FORMAT, LINEAR, PACK)                                                                \
    int LINEAR(const float *, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t, int) { return -2; } \
    int PACK(const uint8_t *, const float *, const float *, uint8_t *, int64_t, int64_t) { return -2; }
#endif
PARROT_GROUPED_ENTRIES(Q4_1, parrot_linear_q4, parrot_pack_q4)
PARROT_GROUPED_ENTRIES(Q8_0, parrot_linear_q8, parrot_pack_q8)

}  // extern "C"
