// What the CPU kernels share (kernels/native/*.cpp): bf16 <-> fp32 as torch converts, and a vector of
// floats in GCC/Clang's vector extension (inline: each file's copy is the same definition).

#pragma once

#include <cstdint>
#include <cstring>

inline float bf16_to_float(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float x) {  // round to nearest even, as torch converts; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// Lanes of a vector in GCC/Clang's vector extension: the compiler keeps these in registers and picks the
// target's instructions (AVX-512 here, two AVX2 or four NEON registers elsewhere).
constexpr int64_t kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float UnalignedVec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

typedef int32_t IntVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float *from) { return *reinterpret_cast<const UnalignedVec *>(from); }
inline void save(float *to, Vec x) { *reinterpret_cast<UnalignedVec *>(to) = x; }

// exp lane by lane for -87 <= x <= 88 (callers clamp to what they need): Cephes' expf polynomial after
// x = n ln2 + r, n rounded by the 1.5 x 2^23 trick and 2^n made from its bits; relative error ~1e-7.
inline Vec exp_in_range(Vec x) {
    const Vec magic = Vec{} + 12582912.0f;
    const Vec n = (x * 1.44269504088896341f + magic) - magic;
    Vec r = n * -0.693359375f + x;
    r = n * 2.12194440e-4f + r;
    Vec p = Vec{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const IntVec bits = (__builtin_convertvector(n, IntVec) + 127) << 23;
    Vec two_to_n;
    std::memcpy(&two_to_n, &bits, sizeof two_to_n);
    return p * two_to_n;
}

// One value from a vector's lanes, combined as a tree by `combine` (a loop over the lanes is one chain
// of dependent operations).
template <typename Combine>
inline float reduce_lanes(Vec x, Combine combine) {
    x = combine(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = combine(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = combine(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = combine(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return x[0];
}

inline float sum_lanes(Vec x) {
    return reduce_lanes(x, [](Vec a, Vec b) { return a + b; });
}

inline float max_lanes(Vec x) {
    return reduce_lanes(x, [](Vec a, Vec b) { return a > b ? a : b; });
}
