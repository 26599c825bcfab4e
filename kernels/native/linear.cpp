// A linear layer over a few rows (a batch-1 decode step): out = x @ weight.T (+ bias), x [M, K] and out
// [M, N] contiguous, the [N, K] weight blocked by kernels/row_linear.py's pack() as [N/4][K/S][4][S]: a
// tile's 4 rows S inputs at a time (S = one vector: 32 bf16 or 16 fp32), so each thread reads its band of
// the weight as one sequential stream.
//
// Why: a decode step of a small model is one pass over every weight, so it runs at the speed weights
// stream from memory. oneDNN's bf16 GEMM with one row reaches ~18 GB/s over SmolLM2's layers here (2
// cores, AVX-512 BF16), torch's fp32 GEMV less; this loop reaches ~29 GB/s, a plain read's rate
// (`python benchmarks/kernels.py --cpu`, its "linear" rows; the same loop over row-major weights, four
// streams a tile, reached ~23). Each thread takes a contiguous band of output features; a tile is 4
// weight rows x up to 4 input rows, the weight vectors kept in registers while each input row multiplies them.
//
// bf16 multiplies on the CPU's bf16 dot product (pairs summed in fp32) and rounds the fp32 sums to bf16
// as torch does (nearest even); fp32 uses fused multiply-adds. Built with the attention kernels by
// kernels/native.py; called through kernels/row_linear.py.

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


constexpr int64_t kTileOut = 4;   // weight rows per tile
constexpr int64_t kTileRows = 4;  // input rows per tile
// The sums of one tile: kTileOut weight rows against `rows` (1..kTileRows) input rows.
template <typename T>
struct Tile;

template <>
struct Tile<float> {
    static constexpr int64_t kStep = kLanes;
    static void sums(const float *weight, const float *x, int64_t rows, int64_t in_features, float out[kTileRows][kTileOut]) {
        Vec acc[kTileRows][kTileOut] = {};
        for (int64_t k = 0; k < in_features; k += kStep) {
            Vec w[kTileOut];
            for (int64_t o = 0; o < kTileOut; o++) w[o] = load(weight + k * kTileOut + o * kStep);
            for (int64_t r = 0; r < kTileRows; r++) {
                if (r >= rows) break;
                Vec xv = load(x + r * in_features + k);
                for (int64_t o = 0; o < kTileOut; o++) acc[r][o] += w[o] * xv;
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < kTileOut; o++) out[r][o] = sum_lanes(acc[r][o]);
    }
    static float value(const float *from) { return *from; }
    static void store(float *to, float x) { *to = x; }
};

#if defined(__AVX512BF16__)
template <>
struct Tile<uint16_t> {
    static constexpr int64_t kStep = 32;
    static void sums(const uint16_t *weight, const uint16_t *x, int64_t rows, int64_t in_features,
                     float out[kTileRows][kTileOut]) {
        __m512 acc[kTileRows][kTileOut];
        for (int64_t r = 0; r < kTileRows; r++)
            for (int64_t o = 0; o < kTileOut; o++) acc[r][o] = _mm512_setzero_ps();
        for (int64_t k = 0; k < in_features; k += kStep) {
            __m512bh w[kTileOut];
            for (int64_t o = 0; o < kTileOut; o++) w[o] = (__m512bh)_mm512_loadu_si512(weight + k * kTileOut + o * kStep);
            for (int64_t r = 0; r < kTileRows; r++) {
                if (r >= rows) break;
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * in_features + k);
                for (int64_t o = 0; o < kTileOut; o++) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], w[o], xv);
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < kTileOut; o++) out[r][o] = _mm512_reduce_add_ps(acc[r][o]);
    }
    static float value(const uint16_t *from) { return bf16_to_float(*from); }
    static void store(uint16_t *to, float x) { *to = float_to_bf16(x); }
};
#endif

template <typename T>
int linear(const T *x, const T *weight, const T *bias, T *out, int64_t rows, int64_t out_features,
           int64_t in_features, int num_threads) {
    if (in_features % Tile<T>::kStep != 0 || out_features % kTileOut != 0) return -1;
    const int64_t tiles = out_features / kTileOut;
#pragma omp parallel num_threads(num_threads)
    {
        int thread = 0, threads = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        // One contiguous band of output features per thread: each streams its part of the weight once.
        const int64_t first = tiles * thread / threads, last = tiles * (thread + 1) / threads;
        float sums[kTileRows][kTileOut];
        for (int64_t tile = first; tile < last; tile++) {
            const T *weight_rows = weight + tile * kTileOut * in_features;
            for (int64_t row = 0; row < rows; row += kTileRows) {
                const int64_t count = rows - row < kTileRows ? rows - row : kTileRows;
                Tile<T>::sums(weight_rows, x + row * in_features, count, in_features, sums);
                for (int64_t r = 0; r < count; r++)
                    for (int64_t o = 0; o < kTileOut; o++) {
                        const int64_t feature = tile * kTileOut + o;
                        const float b = bias ? Tile<T>::value(bias + feature) : 0.0f;
                        Tile<T>::store(out + (row + r) * out_features + feature, sums[r][o] + b);
                    }
            }
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
