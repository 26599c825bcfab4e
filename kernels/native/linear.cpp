// A linear layer over the few rows of a decode step: out = x @ weight.T (+ bias), x [M, K] and out [M, N]
// contiguous, the [N, K] weight packed by kernels/decode_linear.py's pack() as [N/32][K/P][32][P]: for
// each block of 32 output features, P inputs at a time (P = 2 bf16, a pair the CPU's bf16 dot product
// takes, or 1 fp32), so a block is one sequential stream and each step of it is two vectors of weights.
//
// Why: a decode step of a small model is one pass over every weight with a few rows, too few for a GEMM
// library's blocking to pay off. Each input value (pair) is broadcast to a vector and multiplies the
// block's two weight vectors, up to 12 rows at once: 24 accumulators in registers, no horizontal sums.
// Over SmolLM2's 120 decoder linears here (`python benchmarks/kernels.py --cpu`, "linear" rows) that
// streams the weights at a plain read's rate for 1-8 rows and beats oneDNN's prepacked bf16 GEMM up to
// ~32 rows; above that oneDNN's blocking wins and the caller keeps it.
//
// bf16 sums pairs in fp32 (vdpbf16ps) and rounds to bf16 to nearest even, as torch does; fp32 uses fused
// multiply-adds. Built with the attention kernels by kernels/native.py.

#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.h"

namespace {

constexpr int64_t kBlockCols = 32;  // output features per block: two vectors of 16 fp32 sums
constexpr int kMaxRows = 12;        // rows per pass: 24 accumulators, the weights, the broadcast input

// One dtype's arithmetic: Weights is two vectors of a block's step, Input one row's broadcast step.
template <typename T>
struct Ops;

template <>
struct Ops<float> {
    static constexpr int64_t kPack = 1;
    typedef Vec Sum;
    struct Weights { Vec low, high; };
    static Sum zero() { return Vec{}; }
    static Weights weights(const float *block_step) { return {load(block_step), load(block_step + kLanes)}; }
    static Vec input(const float *x) { return *x + Vec{}; }
    static void multiply_add(Sum &sum, Vec input, Vec weight) { sum += input * weight; }
    static void store(float *to, Sum sum, const float *bias) {
        if (bias) sum += load(bias);
        save(to, sum);
    }
};

#if defined(__AVX512BF16__)
template <>
struct Ops<uint16_t> {
    static constexpr int64_t kPack = 2;
    typedef __m512 Sum;
    struct Weights { __m512bh low, high; };
    static Sum zero() { return _mm512_setzero_ps(); }
    static Weights weights(const uint16_t *block_step) {
        return {(__m512bh)_mm512_loadu_si512(block_step), (__m512bh)_mm512_loadu_si512(block_step + 2 * kLanes)};
    }
    static __m512bh input(const uint16_t *x) {  // the pair x[k], x[k+1] in every lane
        int32_t pair;
        std::memcpy(&pair, x, sizeof pair);
        return (__m512bh)_mm512_set1_epi32(pair);
    }
    static void multiply_add(Sum &sum, __m512bh input, __m512bh weight) { sum = _mm512_dpbf16_ps(sum, input, weight); }
    static void store(uint16_t *to, Sum sum, const uint16_t *bias) {
        if (bias)  // bf16 -> fp32 is a shift into the high half
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(bias))), 16)));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(to), (__m256i)_mm512_cvtneps_pbh(sum));
    }
};
#endif

// Rows x one block: `unroll` sets of accumulators take alternate steps, so that few rows still have
// enough independent sums in flight to hide the multiply-add latency.
template <typename T, int rows, int unroll>
void block_rows(const T *block, const T *x, int64_t in_features, const T *bias, T *out, int64_t out_features) {
    using O = Ops<T>;
    constexpr int64_t step = O::kPack * kBlockCols;  // a block's weights per input step
    typename O::Sum sums[unroll][rows][2];
    for (int u = 0; u < unroll; u++)
        for (int r = 0; r < rows; r++) sums[u][r][0] = sums[u][r][1] = O::zero();
    const int64_t steps = in_features / O::kPack;
    int64_t s = 0;
    for (; s + unroll <= steps; s += unroll)
        for (int u = 0; u < unroll; u++) {
            const auto w = O::weights(block + (s + u) * step);
            for (int r = 0; r < rows; r++) {
                const auto input = O::input(x + r * in_features + (s + u) * O::kPack);
                O::multiply_add(sums[u][r][0], input, w.low);
                O::multiply_add(sums[u][r][1], input, w.high);
            }
        }
    for (; s < steps; s++) {
        const auto w = O::weights(block + s * step);
        for (int r = 0; r < rows; r++) {
            const auto input = O::input(x + r * in_features + s * O::kPack);
            O::multiply_add(sums[0][r][0], input, w.low);
            O::multiply_add(sums[0][r][1], input, w.high);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int half = 0; half < 2; half++) {
            auto sum = sums[0][r][half];
            for (int u = 1; u < unroll; u++) sum = sum + sums[u][r][half];
            O::store(out + r * out_features + half * kLanes, sum, bias ? bias + half * kLanes : nullptr);
        }
}

template <typename T>
using BlockRows = void (*)(const T *, const T *, int64_t, const T *, T *, int64_t);

// At most 24 accumulators: unrolled steps for few rows, one set from 7 rows up.
template <typename T>
BlockRows<T> block_rows_for(int64_t rows) {
    switch (rows) {
        case 1: return block_rows<T, 1, 4>;
        case 2: return block_rows<T, 2, 4>;
        case 3: return block_rows<T, 3, 4>;
        case 4: return block_rows<T, 4, 3>;
        case 5: return block_rows<T, 5, 2>;
        case 6: return block_rows<T, 6, 2>;
        case 7: return block_rows<T, 7, 1>;
        case 8: return block_rows<T, 8, 1>;
        case 9: return block_rows<T, 9, 1>;
        case 10: return block_rows<T, 10, 1>;
        case 11: return block_rows<T, 11, 1>;
        default: return block_rows<T, 12, 1>;
    }
}

template <typename T>
int linear(const T *x, const T *weight, const T *bias, T *out, int64_t rows, int64_t out_features,
           int64_t in_features, int num_threads) {
    if (in_features % Ops<T>::kPack != 0 || out_features % kBlockCols != 0 || rows < 0) return -1;
    const int64_t blocks = out_features / kBlockCols;
    // Rows in passes of equal size (16 rows: two of 8), each pass over a block while it is in cache.
    const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
#pragma omp parallel num_threads(num_threads)
    {
        int thread = 0, threads = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        // One contiguous band of blocks per thread: each streams its part of the weight once.
        const int64_t first = blocks * thread / threads, last = blocks * (thread + 1) / threads;
        for (int64_t block = first; block < last; block++)
            for (int64_t pass = 0; pass < passes; pass++) {
                const int64_t row = rows * pass / passes, end = rows * (pass + 1) / passes;
                const int64_t feature = block * kBlockCols;
                block_rows_for<T>(end - row)(weight + feature * in_features, x + row * in_features, in_features,
                                             bias ? bias + feature : nullptr, out + row * out_features + feature,
                                             out_features);
            }
    }
    return 0;
}

}  // namespace

extern "C" {

int parrot_linear_f32(const float *x, const float *weight, const float *bias, float *out, int64_t rows,
                      int64_t out_features, int64_t in_features, int num_threads) {
    return linear<float>(x, weight, bias, out, rows, out_features, in_features, num_threads);
}

// -2 where this CPU (or compiler) has no bf16 dot product: the caller keeps torch's path.
int parrot_linear_bf16(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, uint16_t *out, int64_t rows,
                       int64_t out_features, int64_t in_features, int num_threads) {
#if defined(__AVX512BF16__)
    return linear<uint16_t>(x, weight, bias, out, rows, out_features, in_features, num_threads);
#else
    (void)x, (void)weight, (void)bias, (void)out, (void)rows, (void)out_features, (void)in_features, (void)num_threads;
    return -2;
#endif
}

}  // extern "C"
