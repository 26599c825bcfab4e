// Each row's argmax over fp32 rows: the index of its first maximum, a NaN counting as larger than any number (the
// first NaN's index), as torch.argmax answers. A greedy batch takes one per sequence every step, and torch's CPU
// argmax was a visible share of a batched decode step; this takes about what torch's amax (the max alone) does
// (`python benchmarks/kernels.py --cpu`, "argmax"; the figures: docs/engine.md, "Measurements behind design
// choices").
// One pass a row (and a second from its start for a row holding a NaN): each lane keeps its first maximum and
// where it was, then the lanes' largest value at the smallest index wins.

#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

int64_t first_nan(const float *row, int64_t cols) {
    for (int64_t i = 0; i < cols; i++)
        if (std::isnan(row[i])) return i;
    return -1;
}

// From index `begin` on, given the best so far (value at index best_at, no NaN before begin).
int64_t scalar_argmax(const float *row, int64_t begin, int64_t cols, float best, int64_t best_at) {
    for (int64_t i = begin; i < cols; i++) {
        if (std::isnan(row[i])) return i;
        if (row[i] > best) best = row[i], best_at = i;
    }
    return best_at;
}

int64_t row_argmax(const float *row, int64_t cols) {
#if defined(__AVX512F__)
    if (cols >= 16) {
        __m512 best = _mm512_loadu_ps(row);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), best_at = at;
        __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
        int64_t i = 16;
        for (; i + 16 <= cols; i += 16) {
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
            const __m512 x = _mm512_loadu_ps(row + i);
            const __mmask16 greater = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            best = _mm512_mask_mov_ps(best, greater, x);
            best_at = _mm512_mask_mov_epi32(best_at, greater, at);
        }
        if (nan) return first_nan(row, cols);
        alignas(64) float values[16];
        alignas(64) int32_t indices[16];
        _mm512_store_ps(values, best);
        _mm512_store_si512(indices, best_at);
        int64_t lane = 0;
        for (int l = 1; l < 16; l++)
            if (values[l] > values[lane] || (values[l] == values[lane] && indices[l] < indices[lane])) lane = l;
        return scalar_argmax(row, i, cols, values[lane], indices[lane]);  // the tail's indices come after the lanes'
    }
#endif
    return std::isnan(row[0]) ? 0 : scalar_argmax(row, 1, cols, row[0], 0);
}

}  // namespace

extern "C" {

// out[r] = the argmax of row r (cols values from x + r * row_stride), for cols >= 1 and fewer than 2^31 (the lanes
// hold 32-bit indices). Returns 0, or -1 (nothing written) for sizes it does not take.
int parrot_argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out,
                           int num_threads) {
    if (rows < 0 || cols < 1 || cols >= (int64_t{1} << 31) || row_stride < cols) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * row_stride, cols);
    return 0;
}

}  // extern "C"
