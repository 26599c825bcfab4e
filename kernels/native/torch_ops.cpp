// The linear kernels (linear.cpp) as torch operators with C++ bodies: parrot_native::linear and
// parrot_native::gated_linear, the same contracts as kernels/native_linear.py's Python-bodied parrot:: ops, and
// parrot_native::linear_q4 and ::linear_q8 (group-quantized weights; engines/builtin/quantization.py's int4 and
// int8, which have torch's kernels where this library does not build);
// and a compiled forward's attention, parrot_native::attention (KV write and paged_attention.cpp's decode, see
// below), which engines/builtin/compiled_model.py calls instead of the Python-bodied parrot::paged_attention.
//
// Why: a bf16 decode step makes 120 linear calls, and each went dispatcher -> Python -> ctypes -> kernel,
// spending time before the kernel ran (the Python side's checks, an empty tensor, the ctypes conversions) that
// added up to a sizeable share of a single-stream step. The dispatcher calls these bodies directly, for a
// fraction of that a call (the figures: docs/engine.md, "Measurements behind design choices"). Built by
// kernels/native.py's torch_ops() with torch's headers (slow, once, cached); where that build fails the
// Python-bodied ops serve.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "c_api.h"

namespace {

// Inputs a packed step takes (kernels/native.py's LINEAR_PACK); 0 for a dtype the kernel has none for.
int64_t pack_of(at::ScalarType dtype) {
    return dtype == at::kBFloat16 ? 2 : dtype == at::kFloat ? 1 : 0;
}

// (out_features, in_features) of `packed`, or a ValueError where x, it and bias do not go together.
std::pair<int64_t, int64_t> checked(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias) {
    const at::ScalarType dtype = packed.scalar_type();
    const int64_t pack = pack_of(dtype);
    const bool blocked = pack > 0 && packed.dim() == 4 && packed.size(2) == kBlockCols && packed.size(3) == pack &&
                         packed.is_contiguous() && packed.device().is_cpu();
    const int64_t out_features = blocked ? packed.size(0) * kBlockCols : 0, in_features = blocked ? packed.size(1) * pack : 0;
    TORCH_CHECK_VALUE(blocked && x.dim() == 2 && x.size(1) == in_features && x.scalar_type() == dtype &&
                          x.device().is_cpu() &&
                          (!bias || (bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == out_features)),
                      "the native linear does not take x ", x.sizes(), " ", x.scalar_type(), ", packed weight ",
                      packed.sizes(), " ", dtype);
    return {out_features, in_features};
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias) {
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

at::Tensor gated_linear(const at::Tensor &x, const at::Tensor &packed) {
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


// x [rows, K] fp32 @ a group-quantized weight packed by parrot_pack_q4 or parrot_pack_q8 ([N/32, bytes_per_input * K]
// uint8: the format's kQ4BlockBytesPerInput or kQ8BlockBytesPerInput) + bias, by `kernel` (parrot_linear_q4, _q8).
using GroupedKernel = int (*)(const float *, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t, int);

template <GroupedKernel kernel, int64_t bytes_per_input>
at::Tensor grouped_linear(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias) {
    const bool blocked = packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                         packed.device().is_cpu() && packed.size(1) % (bytes_per_input * kGroupInputs) == 0;
    const int64_t out_features = blocked ? packed.size(0) * kBlockCols : 0;
    const int64_t in_features = blocked ? packed.size(1) / bytes_per_input : 0;
    TORCH_CHECK_VALUE(blocked && x.dim() == 2 && x.size(1) == in_features && x.scalar_type() == at::kFloat &&
                          x.device().is_cpu() &&
                          (!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == out_features)),
                      "the group-quantized linear does not take x ", x.sizes(), " ", x.scalar_type(), ", packed weight ",
                      packed.sizes(), " ", packed.scalar_type());
    const at::Tensor input = x.contiguous();
    const std::optional<at::Tensor> added = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    at::Tensor out = at::empty({input.size(0), out_features}, input.options());
    const int status = kernel(input.const_data_ptr<float>(), packed.const_data_ptr<uint8_t>(),
                              added ? added->const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>(),
                              input.size(0), out_features, in_features, at::get_num_threads());
    TORCH_CHECK_VALUE(status == 0, "the group-quantized linear refused x ", x.sizes(), " with a weight of ",
                      out_features, "x", in_features);
    return out;
}

// ---- attention: a compiled forward's layers over the paged cache (engines/builtin/compiled_model.py) ----
// The graph calls parrot_native::attention(q, k, v, forward, layer) and never sees the caches (a frozen graph
// would take them for constants) nor the step's tables (new every step). They are held here instead, as
// tensors (so nothing they point at can be freed while held): each layer's caches and scale from the forward's
// start (register_forward), the step's slots and tables before each forward (set_step).
struct StepArgs {
    at::Tensor slots, own_tables, own_lens;
    std::optional<at::Tensor> prefix_ids, prefix_tables, prefix_lens;
};

struct Forward {
    std::vector<at::Tensor> k_caches, v_caches;
    std::vector<double> scales;
    std::optional<StepArgs> step;
};

std::mutex forwards_lock;
std::unordered_map<int64_t, Forward> forwards;

void register_forward(int64_t forward, const std::vector<at::Tensor> &k_caches, const std::vector<at::Tensor> &v_caches,
                      const std::vector<double> &scales) {
    TORCH_CHECK_VALUE(k_caches.size() == v_caches.size() && k_caches.size() == scales.size(), "one cache pair and scale a layer");
    for (size_t i = 0; i < k_caches.size(); i++) {
        const at::Tensor &k = k_caches[i], &v = v_caches[i];
        TORCH_CHECK_VALUE(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
                              (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                              k.is_contiguous() && v.is_contiguous() && k.device().is_cpu() && v.device().is_cpu(),
                          "layer ", i, "'s caches are not contiguous CPU [blocks, block size, kv heads, dim] fp32/bf16 pairs");
    }
    std::lock_guard<std::mutex> guard(forwards_lock);
    forwards[forward] = Forward{k_caches, v_caches, scales, std::nullopt};
}

void drop_forward(int64_t forward) {
    std::lock_guard<std::mutex> guard(forwards_lock);
    forwards.erase(forward);
}

at::Tensor int32_rows(const at::Tensor &t, const char *name, int64_t dim) {
    TORCH_CHECK_VALUE(t.scalar_type() == at::kInt && t.dim() == dim && t.device().is_cpu(), name,
                      " must be a CPU int32 tensor with ", dim, " dims");
    return t.contiguous();
}

void set_step(int64_t forward, const at::Tensor &slots, const at::Tensor &own_tables, const at::Tensor &own_lens,
              const std::optional<at::Tensor> &prefix_ids, const std::optional<at::Tensor> &prefix_tables,
              const std::optional<at::Tensor> &prefix_lens) {
    TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.device().is_cpu(),
                      "slots must be a CPU int64 vector");
    StepArgs step{slots.contiguous(), int32_rows(own_tables, "own_tables", 2), int32_rows(own_lens, "own_lens", 1),
                  std::nullopt, std::nullopt, std::nullopt};
    TORCH_CHECK_VALUE(step.own_lens.size(0) == step.own_tables.size(0), "one length a table row");
    if (prefix_ids) {
        TORCH_CHECK_VALUE(prefix_tables && prefix_lens, "prefix ids need their tables and lengths");
        step.prefix_ids = int32_rows(*prefix_ids, "prefix_ids", 1);
        step.prefix_tables = int32_rows(*prefix_tables, "prefix_tables", 2);
        step.prefix_lens = int32_rows(*prefix_lens, "prefix_lens", 1);
        TORCH_CHECK_VALUE(step.prefix_ids->size(0) == step.own_tables.size(0) &&
                              step.prefix_lens->size(0) == step.prefix_tables->size(0),
                          "a prefix id a row, a length a prefix table row");
    }
    std::lock_guard<std::mutex> guard(forwards_lock);
    const auto found = forwards.find(forward);
    TORCH_CHECK_VALUE(found != forwards.end(), "no forward ", forward, " registered");
    found->second.step = std::move(step);
}

// [tokens, heads, D] with each token's heads contiguous, as the kernels read it (any token stride).
bool token_rows(const at::Tensor &x) {
    return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2);
}

// One cache dtype's C kernels (c_api.h), T its values as they take them (bf16: its 16 bits).
template <typename T>
struct CacheKernels;
template <>
struct CacheKernels<float> {
    static constexpr auto write = parrot_write_kv_f32;
    static constexpr auto decode = parrot_decode_f32;
};
template <>
struct CacheKernels<uint16_t> {
    static constexpr auto write = parrot_write_kv_bf16;
    static constexpr auto decode = parrot_decode_bf16;
};

template <typename T>
const T *values(const at::Tensor &t) { return static_cast<const T *>(t.const_data_ptr()); }
template <typename T>
T *mutable_values(const at::Tensor &t) { return static_cast<T *>(t.mutable_data_ptr()); }
const int32_t *int32s_or_null(const std::optional<at::Tensor> &t) { return t ? t->const_data_ptr<int32_t>() : nullptr; }

// The layer's new keys and values written at the step's slots (an out-of-range slot raises, nothing written),
// then its attention over the caches into out; the decode kernel's status.
template <typename T>
int write_and_attend(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &k_cache,
                     const at::Tensor &v_cache, const StepArgs &step, double scale, const at::Tensor &out) {
    using Kernels = CacheKernels<T>;
    const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2),
                  dim = k_cache.size(3), slots = num_blocks * block_size;
    const int written = Kernels::write(values<T>(k), values<T>(v), mutable_values<T>(k_cache), mutable_values<T>(v_cache),
                                       step.slots.const_data_ptr<int64_t>(), k.size(0), kv_heads * dim, slots,
                                       k.stride(0), v.stride(0));
    TORCH_CHECK_INDEX(written == 0, "a slot is past the cache's ", slots, " slots");
    return Kernels::decode(values<T>(q), values<T>(k_cache), values<T>(v_cache), int32s_or_null(step.prefix_ids),
                           int32s_or_null(step.prefix_tables), step.prefix_tables ? step.prefix_tables->stride(0) : 0,
                           int32s_or_null(step.prefix_lens), step.prefix_lens ? step.prefix_lens->size(0) : 0,
                           step.own_tables.const_data_ptr<int32_t>(), step.own_tables.stride(0),
                           step.own_lens.const_data_ptr<int32_t>(), nullptr, mutable_values<T>(out), q.size(0), q.size(1),
                           kv_heads, dim, block_size, num_blocks, static_cast<float>(scale), q.stride(0),
                           at::get_num_threads());
}

at::Tensor attention(const at::Tensor &q_in, const at::Tensor &k_in, const at::Tensor &v_in, int64_t forward,
                     int64_t layer) {
    at::Tensor k_cache, v_cache;
    double scale;
    StepArgs step;
    {
        std::lock_guard<std::mutex> guard(forwards_lock);
        const auto found = forwards.find(forward);
        TORCH_CHECK_VALUE(found != forwards.end() && found->second.step, "no step set for forward ", forward);
        const Forward &f = found->second;
        TORCH_CHECK_INDEX(layer >= 0 && layer < static_cast<int64_t>(f.k_caches.size()), "no layer ", layer);
        k_cache = f.k_caches[layer], v_cache = f.v_caches[layer], scale = f.scales[layer], step = *f.step;
    }
    const at::Tensor q = token_rows(q_in) ? q_in : q_in.contiguous();
    const at::Tensor k = token_rows(k_in) ? k_in : k_in.contiguous(), v = token_rows(v_in) ? v_in : v_in.contiguous();
    const at::ScalarType dtype = k_cache.scalar_type();
    const int64_t num_blocks = k_cache.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3),
                  batch = step.own_tables.size(0);
    TORCH_CHECK_VALUE(q.dim() == 3 && q.size(0) == batch && q.size(2) == dim && q.size(1) % kv_heads == 0 &&
                          k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == step.slots.size(0) &&
                          k.size(1) == kv_heads && k.size(2) == dim && q.scalar_type() == dtype &&
                          k.scalar_type() == dtype && v.scalar_type() == dtype && q.device().is_cpu() &&
                          k.device().is_cpu() && v.device().is_cpu(),
                      "the native attention does not take q ", q.sizes(), ", k ", k.sizes(), " over caches ",
                      k_cache.sizes(), " for ", batch, " rows and ", step.slots.size(0), " new tokens");
    at::Tensor out = at::empty(q.sizes(), q.options());
    const int status = dtype == at::kBFloat16 ? write_and_attend<uint16_t>(q, k, v, k_cache, v_cache, step, scale, out)
                                              : write_and_attend<float>(q, k, v, k_cache, v_cache, step, scale, out);
    TORCH_CHECK_INDEX(status != -2, "a block table names a block past the cache's ", num_blocks, " blocks");
    TORCH_CHECK_VALUE(status == 0, "the native attention does not take head_dim ", dim, " with ", q.size(1), " heads");
    return out;
}
}  // namespace

TORCH_LIBRARY(parrot_native, m) {
    m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
    m.def("gated_linear(Tensor x, Tensor packed) -> Tensor");
    m.def("linear_q4(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
    m.def("linear_q8(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
    m.def("register_forward(int forward, Tensor[] k_caches, Tensor[] v_caches, float[] scales) -> ()");
    m.def("drop_forward(int forward) -> ()");
    m.def("set_step(int forward, Tensor slots, Tensor own_tables, Tensor own_lens, Tensor? prefix_ids, "
          "Tensor? prefix_tables, Tensor? prefix_lens) -> ()");
    m.def("attention(Tensor q, Tensor k, Tensor v, int forward, int layer) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_native, CPU, m) {
    m.impl("linear", linear);
    m.impl("gated_linear", gated_linear);
    m.impl("linear_q4", grouped_linear<parrot_linear_q4, kQ4BlockBytesPerInput>);
    m.impl("linear_q8", grouped_linear<parrot_linear_q8, kQ8BlockBytesPerInput>);
    m.impl("attention", attention);
}

TORCH_LIBRARY_IMPL(parrot_native, CatchAll, m) {
    m.impl("register_forward", register_forward);
    m.impl("drop_forward", drop_forward);
    m.impl("set_step", set_step);
}
