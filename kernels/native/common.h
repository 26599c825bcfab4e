// What the CPU kernels share (kernels/native/*.cpp): bf16 <-> fp32 as torch converts, and a vector of
// floats in GCC/Clang's vector extension (inline: each file's copy is the same definition).

#pragma once

#include <cstdint>
#include <cstring>

// AMX tiles (Sapphire Rapids and later): a tile multiply-add takes 16 rows x 32 bf16 against 32 x 16 in one
// instruction, several times the vector bf16 dot product's rate (a loop of them alone: ~1.3-1.8 TFLOP/s a
// core here, the vector dot product ~240). Built where the compiler targets them (-march=native on such a
// CPU); used where Linux grants the process the tile state, unless parrot_use_tiles(0) turned them off.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PARROT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

inline bool &tiles_enabled() {  // parrot_use_tiles(): off only to compare with the vector paths
    static bool enabled = true;
    return enabled;
}

#if defined(PARROT_AMX)
// Linux hands out the 8 KB tile state only to a process that asks for it (arch_prctl), once.
inline bool tiles_permitted() {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
    return permitted;
}

// The calling thread's 8 tiles, tile i `rows[i]` rows of 64 bytes (0: unused). A thread must configure its
// tiles before using them, and should release them (_tile_release) when done: while a thread holds tile
// state every context switch saves 8 KB more.
inline void configure_tiles(const uint8_t (&rows)[8]) {
    struct alignas(64) {
        uint8_t palette = 1, start_row = 0, reserved[14] = {};
        uint16_t bytes_per_row[16] = {};
        uint8_t rows[16] = {};
    } config;
    for (int tile = 0; tile < 8; tile++) config.rows[tile] = rows[tile], config.bytes_per_row[tile] = rows[tile] ? 64 : 0;
    // GCC does not see ldtilecfg read the struct and may drop the stores above: make them happen first.
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}
#endif

// Gives the calling thread's tile state back (nothing to give without AMX).
inline void release_tiles() {
#if defined(PARROT_AMX)
    _tile_release();
#endif
}

// Whether bf16 products go through tiles here now.
inline bool tiles_usable() {
#if defined(PARROT_AMX)
    return tiles_enabled() && tiles_permitted();
#else
    return false;
#endif
}

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

// A vector of floats in GCC/Clang's vector extension, as wide as the target's registers: 16 lanes on AVX-512, 8
// elsewhere (AVX2; two NEON registers). The compiler keeps these in registers. Wider than the registers, they
// compile to shuffles through the stack: with 16 lanes on an AVX2 CPU (an AMD EPYC), the fp32 linear ran at
// ~14 GFLOP/s at any row count from 8 up and the prefill attention ~12x slower than torch's SDPA.
#if defined(__AVX512F__)
#define PARROT_LANES 16
// Vecs the vector registers hold: kernels size the sums they keep in registers by it (more spill to the stack).
constexpr int kVecRegisters = 32;
#else
#define PARROT_LANES 8
constexpr int kVecRegisters = 16;
#endif
constexpr int64_t kLanes = PARROT_LANES;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float UnalignedVec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

typedef int32_t IntVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float *from) { return *reinterpret_cast<const UnalignedVec *>(from); }
inline void save(float *to, Vec x) { *reinterpret_cast<UnalignedVec *>(to) = x; }
// x in every lane. Not `x + Vec{}`: adding +0 is no identity for -0, so the compiler kept a scalar add and
// broadcast from a register, two more vector-port instructions beside each row's two multiply-adds, which held
// the fp32 linear at ~105 GFLOP/s on 2 cores; x - 0 is x for every x when rounding to nearest (the default; the
// kernels are not built with -frounding-math), so this folds to a broadcast load.
inline Vec splat(float x) { return x - Vec{}; }

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
// 16 vectors of 16 32-bit lanes transposed in registers: rows[c] lane r <- rows[r] lane c.
inline void transpose_lanes(__m512i rows[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(rows[i + j], rows[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(rows[i + j], rows[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        rows[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        rows[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}
#elif defined(__AVX2__)
// The same on AVX2: 8 vectors of 8 floats transposed in registers.
inline void transpose_lanes(__m256 rows[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int j = 0; j < 4; j++) {
        rows[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
        rows[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
}
#endif

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
#if PARROT_LANES == 16
    x = combine(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = combine(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = combine(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = combine(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
    x = combine(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
    x = combine(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5));
    x = combine(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
    return x[0];
}

inline float sum_lanes(Vec x) {
    return reduce_lanes(x, [](Vec a, Vec b) { return a + b; });
}

inline float max_lanes(Vec x) {
    return reduce_lanes(x, [](Vec a, Vec b) { return a > b ? a : b; });
}
