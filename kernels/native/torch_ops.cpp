// The linear kernels (linear.cpp) as torch operators with C++ bodies: parrot_native::linear and
// parrot_native::gated_linear, the same contracts as kernels/native_linear.py's Python-bodied parrot:: ops.
//
// Why: a bf16 decode step makes 120 linear calls, and each went dispatcher -> Python -> ctypes -> kernel:
// ~15-19 us of a call's time here before the kernel ran (the Python side's checks, an empty tensor, the
// ctypes conversions), 2-3 ms of a ~17-22 ms single-stream step. The dispatcher calls these bodies
// directly (~3 us a call with its output tensor). Built by kernels/native.py's torch_ops() with torch's
// headers (about 15 s, once, cached); where that build fails the Python-bodied ops serve.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <utility>

extern "C" {
int parrot_linear_f32(const float *x, const float *weight, const float *bias, float *out, int64_t rows,
                      int64_t out_features, int64_t in_features, int num_threads);
int parrot_gated_linear_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t out_features,
                            int64_t in_features, int num_threads);
int parrot_linear_bf16(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, uint16_t *out, int64_t rows,
                       int64_t out_features, int64_t in_features, int num_threads);
int parrot_gated_linear_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                             int64_t out_features, int64_t in_features, int num_threads);
}

namespace {

constexpr int64_t kBlock = 32;     // linear.cpp's kBlockCols (kernels/native.py's LINEAR_BLOCK)
constexpr int64_t kGemmRows = 32;  // kernels/native_linear.py's GEMM_ROWS: fp32 calls of this many rows go to torch's GEMM

// Inputs a packed step takes (kernels/native.py's LINEAR_PACK); 0 for a dtype the kernel has none for.
int64_t pack_of(at::ScalarType dtype) {
    return dtype == at::kBFloat16 ? 2 : dtype == at::kFloat ? 1 : 0;
}

// (out_features, in_features) of `packed`, or a ValueError where x, it and bias do not go together.
std::pair<int64_t, int64_t> checked(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias) {
    const at::ScalarType dtype = packed.scalar_type();
    const int64_t pack = pack_of(dtype);
    const bool blocked = pack > 0 && packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == pack &&
                         packed.is_contiguous() && packed.device().is_cpu();
    const int64_t out_features = blocked ? packed.size(0) * kBlock : 0, in_features = blocked ? packed.size(1) * pack : 0;
    TORCH_CHECK_VALUE(blocked && x.dim() == 2 && x.size(1) == in_features && x.scalar_type() == dtype &&
                          x.device().is_cpu() &&
                          (!bias || (bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == out_features)),
                      "the native linear does not take x ", x.sizes(), " ", x.scalar_type(), ", packed weight ",
                      packed.sizes(), " ", dtype);
    return {out_features, in_features};
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                  const std::optional<at::Tensor> &weight) {
    if (weight && x.size(0) >= kGemmRows) return at::linear(x, *weight, bias);
    const auto [out_features, in_features] = checked(x, packed, bias);
    const at::Tensor input = x.contiguous();
    const std::optional<at::Tensor> added = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    at::Tensor out = at::empty({input.size(0), out_features}, input.options());
    const int threads = at::get_num_threads();
    const int status =
        input.scalar_type() == at::kBFloat16
            ? parrot_linear_bf16(static_cast<const uint16_t *>(input.const_data_ptr()),
                                 static_cast<const uint16_t *>(packed.const_data_ptr()),
                                 added ? static_cast<const uint16_t *>(added->const_data_ptr()) : nullptr,
                                 static_cast<uint16_t *>(out.mutable_data_ptr()), input.size(0), out_features,
                                 in_features, threads)
            : parrot_linear_f32(input.const_data_ptr<float>(), packed.const_data_ptr<float>(),
                                added ? added->const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>(),
                                input.size(0), out_features, in_features, threads);
    TORCH_CHECK_VALUE(status == 0, "the native linear refused x ", x.sizes(), " with a weight of ", out_features, "x",
                      in_features);
    return out;
}

at::Tensor gated_linear(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &weight) {
    if (weight && x.size(0) >= kGemmRows) {
        const auto halves = at::linear(x, *weight).chunk(2, -1);
        return at::mul(at::silu(halves[0]), halves[1]);
    }
    const auto [out_features, in_features] = checked(x, packed, std::nullopt);
    const at::Tensor input = x.contiguous();
    at::Tensor out = at::empty({input.size(0), out_features / 2}, input.options());
    const int threads = at::get_num_threads();
    // An odd count of blocks (not gate and up pairs) leaves half the features off the blocks: refused there.
    const int status =
        input.scalar_type() == at::kBFloat16
            ? parrot_gated_linear_bf16(static_cast<const uint16_t *>(input.const_data_ptr()),
                                       static_cast<const uint16_t *>(packed.const_data_ptr()),
                                       static_cast<uint16_t *>(out.mutable_data_ptr()), input.size(0),
                                       out_features / 2, in_features, threads)
            : parrot_gated_linear_f32(input.const_data_ptr<float>(), packed.const_data_ptr<float>(),
                                      out.mutable_data_ptr<float>(), input.size(0), out_features / 2, in_features,
                                      threads);
    TORCH_CHECK_VALUE(status == 0, "the native gated linear refused x ", x.sizes(), " with a weight of ", out_features,
                      "x", in_features);
    return out;
}

}  // namespace

TORCH_LIBRARY(parrot_native, m) {
    m.def("linear(Tensor x, Tensor packed, Tensor? bias, Tensor? weight=None) -> Tensor");
    m.def("gated_linear(Tensor x, Tensor packed, Tensor? weight=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_native, CPU, m) {
    m.impl("linear", linear);
    m.impl("gated_linear", gated_linear);
}
