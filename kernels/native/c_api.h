// The kernels' C functions that another of these sources calls, declared once: defined in linear.cpp and
// paged_attention.cpp (which include this, so the compiler holds each definition to its declaration), called
// by torch_ops.cpp's operators and greedy_head.cpp. kernels/native.py binds them again through ctypes, where no
// header reaches. bf16 values are their 16 bits (uint16_t), as torch stores them. Also the packed linear weight's
// block, which those sources all read.

#pragma once

#include <cstdint>

// Output features a block of a packed linear weight holds ([N/32][K/P][32][P], kernels/native.py's pack_linear() and
// LINEAR_BLOCK): a row's sums of a block are two AVX-512 vectors, four AVX2.
constexpr int64_t kBlockCols = 32;
// Inputs a group-quantized weight's scale (and minimum) covers (kernels/native.py's GROUP_INPUTS), and the bytes a
// block of one holds per input: for Q4_1 (parrot_pack_q4) 32 features' codes (16 bytes) and, for each group, their
// fp16 scales and minimums (128 bytes, 4 an input); for Q8_0 (parrot_pack_q8) 32 bytes of codes and 2 of scales.
constexpr int64_t kGroupInputs = 32;
constexpr int64_t kQ4BlockBytesPerInput = 20;
constexpr int64_t kQ8BlockBytesPerInput = 34;

extern "C" {

// out [rows, out_features] = x [rows, in_features] @ weight.T (+ bias), the weight packed by
// kernels/native.py's pack_linear(); -1 for sizes the kernel does not take, -2 where the build has no bf16
// dot product.
int parrot_linear_f32(const float *x, const float *weight, const float *bias, float *out, int64_t rows,
                      int64_t out_features, int64_t in_features, int num_threads);
int parrot_linear_bf16(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, uint16_t *out, int64_t rows,
                       int64_t out_features, int64_t in_features, int num_threads);

// out [rows, out_features] = silu(x @ gate.T) * (x @ up.T), the weight packed by pack_gated_linear().
int parrot_gated_linear_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t out_features,
                            int64_t in_features, int num_threads);
int parrot_gated_linear_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                             int64_t out_features, int64_t in_features, int num_threads);

// out [rows, out_features] ~ x @ weight.T (+ bias), fp32, x's rows quantized to int8 per group of 32 inputs inside
// (as llama.cpp computes its Q4_1 and Q8_0), the weight integer codes in groups of 32 inputs with an fp16 scale a
// group and feature: Q4_1's 4-bit codes [N][K] (0-15) with a minimum too (weight = code * scale + minimum), packed
// by parrot_pack_q4 ([N/32][kQ4BlockBytesPerInput * K] bytes), or Q8_0's int8 codes [N][K] (-127..127, weight =
// code * scale), packed by parrot_pack_q8 ([N/32][kQ8BlockBytesPerInput * K] bytes; its minimums unused), from
// scales and minimums [N][K/32]; -1 for sizes the kernel does not take, -2 (all four) where the build has no
// group-quantized kernels (no AVX2, F16C and FMA).
int parrot_linear_q4(const float *x, const uint8_t *weight, const float *bias, float *out, int64_t rows,
                     int64_t out_features, int64_t in_features, int num_threads);
int parrot_pack_q4(const uint8_t *codes, const float *scales, const float *minimums, uint8_t *packed,
                   int64_t out_features, int64_t in_features);
int parrot_linear_q8(const float *x, const uint8_t *weight, const float *bias, float *out, int64_t rows,
                     int64_t out_features, int64_t in_features, int num_threads);
int parrot_pack_q8(const uint8_t *codes, const float *scales, const float *minimums, uint8_t *packed,
                   int64_t out_features, int64_t in_features);

// Paged decode attention (paged_attention.cpp says what each argument is): 0, -1 where this build has no
// kernel for head_dim or the query group, -2 when a table names a block past num_blocks (nothing read).
#define PARROT_DECODE_SIGNATURE(NAME, T)                                                                     \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *prefix_ids,                     \
             const int32_t *prefix_tables, int64_t prefix_stride, const int32_t *prefix_lens,                \
             int64_t num_prefixes, const int32_t *own_tables, int64_t own_stride, const int32_t *own_lens,   \
             const int32_t *firsts, T *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,          \
             int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale, int64_t q_stride,        \
             int num_threads)
PARROT_DECODE_SIGNATURE(parrot_decode_f32, float);
PARROT_DECODE_SIGNATURE(parrot_decode_bf16, uint16_t);

// New tokens' key and value rows stored at their cache slots: 0, or -1 (nothing written) for a slot past
// num_slots.
#define PARROT_WRITE_KV_SIGNATURE(NAME, T)                                                                   \
    int NAME(const T *key, const T *value, T *k_cache, T *v_cache, const int64_t *slots, int64_t num_tokens, \
             int64_t row_elems, int64_t num_slots, int64_t key_stride, int64_t value_stride)
PARROT_WRITE_KV_SIGNATURE(parrot_write_kv_f32, float);
PARROT_WRITE_KV_SIGNATURE(parrot_write_kv_bf16, uint16_t);

}  // extern "C"
