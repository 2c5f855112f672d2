// Strata's CUDA kernels, compiled at run time by NVRTC for the card's compute capability
// (strata-daemon/src/compute/cuda/kernels.rs) and cached on disk by source hash and architecture.
//
// Conventions (all row-major, f32 activations unless named otherwise):
//  - A weight matrix is `rows` rows of `cols` elements in one GGML format; each row is contiguous
//    (GGML block layouts: Q4_0 = f16 d + 16 B nibbles (18 B / 32 values), Q4_1 = f16 d, f16 m + 16 B (20 B),
//    Q8_0 = f16 d + 32 i8 (34 B), F16, BF16, F32).
//  - Activations for the block formats are 8-bit blocks `Q8` (f32 d rounded to f16, f32 s = d * sum(q) rounded
//    to f16, 32 i8), quantized exactly as the CPU path does (strata-daemon/src/quant/dot.rs).
//  - One warp computes one output row for up to 8 tokens (the weight block is read once for all of them).
//  - Expert blobs live in VRAM slots: blob = gate rows | up rows | down rows, verbatim GGUF blocks.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Half-precision conversions without the toolkit's headers (NVRTC alone is enough).
__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float((u32)h << 16); }

#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_Q8_0 3
#define FMT_Q4_0 4
#define FMT_Q4_1 5
// The sub-block formats (generic decode below): compiled into a module only when a model uses them
// (-DSTRATA_FMT_<suffix>, see the end of this file).
#define FMT_Q5_0 6
#define FMT_Q5_1 7
#define FMT_Q2_K 8
#define FMT_Q3_K 9
#define FMT_Q4_K 10
#define FMT_Q5_K 11
#define FMT_Q6_K 12
#define FMT_IQ4_NL 13
#define FMT_IQ4_XS 14
#define FMT_MXFP4 15
// the lattice IQ formats (grids from the header strata_iq_grids.h that the host generates)
#define FMT_IQ2_XXS 16
#define FMT_IQ2_XS 17
#define FMT_IQ2_S 18
#define FMT_IQ3_XXS 19
#define FMT_IQ3_S 20
#define FMT_IQ1_S 21
#define FMT_IQ1_M 22
#define IS_IQ(F) ((F) >= FMT_IQ2_XXS)

#define MAX_NT 8
#define INFINITY __int_as_float(0x7f800000)
#define WARPS 4

struct Q8 {
    float d;
    float s;
    int qs[8];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Programmatic dependent launch (sm_90+, when the host launches with programmatic stream serialization): most
// kernels first let the next kernel in the stream start launching (its blocks then wait here too), then wait
// until the previous kernel has finished and its memory is visible (the one-token expert gate/up kernels wait
// first, then trigger: the narrow down kernel after them reads its groups and stages weights before its wait). So no kernel reads data of the previous
// one or writes anything before the previous one is done, and the launch latency of the next overlaps this
// one. Kernels with a prologue (`pdl_trigger`, reads of weights no kernel writes, `pdl_wait`) also overlap
// their first weight reads with the previous kernel: the dense products stage their rows' first chunk into
// shared memory there, the norms load their weights. Without the launch attribute (or before sm_90) these
// are no-ops.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_entry() {
    pdl_trigger();
    pdl_wait();
}

// Whether this block is the last of its grid to get here (every thread of every block calls it once, after its
// global writes): those writes of every block are then visible to the last block, which has set *done back to 0
// for the next launch (a counter that is 0 before the first launch).
__device__ __forceinline__ bool last_block(unsigned* done) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
        if (last) {
            __threadfence();  // the other blocks' writes, counted before this block's, are seen after the barrier
            *done = 0;        // every other block has counted
        }
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ float h2f(const u8* p) {
    return half_to_float(*(const u16*)p);
}

__device__ __forceinline__ float f16_round(float x) { return half_to_float(float_to_half(x)); }

// 4 bytes at a 2-byte aligned address.
__device__ __forceinline__ int ld_i32_a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (int)((u32)q[0] | ((u32)q[1] << 16));
}

__device__ __forceinline__ int ld_i32_a1(const u8* p) {
    return (int)((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}

// Bytes of one row of `cols` elements.
__device__ __forceinline__ size_t row_bytes(int fmt, int cols) {
    switch (fmt) {
        case FMT_F32: return (size_t)cols * 4;
        case FMT_F16:
        case FMT_BF16: return (size_t)cols * 2;
        case FMT_Q8_0: return (size_t)(cols / 32) * 34;
        case FMT_Q4_0: return (size_t)(cols / 32) * 18;
        case FMT_Q4_1: return (size_t)(cols / 32) * 20;
        case FMT_Q5_0: return (size_t)(cols / 32) * 22;
        case FMT_Q5_1: return (size_t)(cols / 32) * 24;
        case FMT_Q2_K: return (size_t)(cols / 256) * 84;
        case FMT_Q3_K: return (size_t)(cols / 256) * 110;
        case FMT_Q4_K: return (size_t)(cols / 256) * 144;
        case FMT_Q5_K: return (size_t)(cols / 256) * 176;
        case FMT_Q6_K: return (size_t)(cols / 256) * 210;
        case FMT_IQ4_NL: return (size_t)(cols / 32) * 18;
        case FMT_IQ4_XS: return (size_t)(cols / 256) * 136;
        case FMT_IQ2_XXS: return (size_t)(cols / 256) * 66;
        case FMT_IQ2_XS: return (size_t)(cols / 256) * 74;
        case FMT_IQ2_S: return (size_t)(cols / 256) * 82;
        case FMT_IQ3_XXS: return (size_t)(cols / 256) * 98;
        case FMT_IQ3_S: return (size_t)(cols / 256) * 110;
        case FMT_IQ1_S: return (size_t)(cols / 256) * 50;
        case FMT_IQ1_M: return (size_t)(cols / 256) * 56;
        default: return (size_t)(cols / 32) * 17;  // MXFP4
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Sub-block formats (Q5_0, Q5_1, the K-quants, IQ4_NL, IQ4_XS, MXFP4, the lattice IQ formats; block layouts as
// ggml's `ggml-common.h`):
// every product sees a row as 32-value sub-blocks, each paired with one Q8 activation block. A sub-block decodes
// to 32 signed 8-bit integers q (eight words of four) and scales: value_i = d0·q_i + m0 for i < 16 and
// d1·q_i + m1 above (d0 == d1, m0 == m1 unless SUB_HALVES / SUB_MIN == 2), so its dot product with an activation
// block (dx, qx) is dx·(d0·Σ_lo q·qx + d1·Σ_hi q·qx) plus the minimum's term (m0·s for one minimum, where
// s = dx·Σqx; dx·(m0·Σ_lo qx + m1·Σ_hi qx) for two). The K-quants', IQ4_XS's and the lattice formats' 256-value
// super-blocks hold eight sub-blocks; the others are one sub-block each.
#define IS_SUB(F) ((F) >= FMT_Q5_0)
#define SUB_QK(F) ((((F) >= FMT_Q2_K && (F) <= FMT_Q6_K) || (F) == FMT_IQ4_XS || IS_IQ(F)) ? 256 : 32)
#define SUB_BYTES(F)                                                                                         \
    ((F) == FMT_Q5_0 ? 22 : (F) == FMT_Q5_1 ? 24 : (F) == FMT_Q2_K ? 84 : (F) == FMT_Q3_K ? 110               \
     : (F) == FMT_Q4_K ? 144 : (F) == FMT_Q5_K ? 176 : (F) == FMT_Q6_K ? 210 : (F) == FMT_IQ4_NL ? 18          \
     : (F) == FMT_IQ4_XS ? 136 : (F) == FMT_IQ2_XXS ? 66 : (F) == FMT_IQ2_XS ? 74 : (F) == FMT_IQ2_S ? 82      \
     : (F) == FMT_IQ3_XXS ? 98 : (F) == FMT_IQ3_S ? 110 : (F) == FMT_IQ1_S ? 50 : (F) == FMT_IQ1_M ? 56 : 17)
// two scales per sub-block (one per 16 values)
#define SUB_HALVES(F)                                                                                        \
    ((F) == FMT_Q2_K || (F) == FMT_Q3_K || (F) == FMT_Q6_K || (F) == FMT_IQ2_XS || (F) == FMT_IQ2_S ||          \
     (F) == FMT_IQ1_M)
// the minimum: 0 none, 1 one per sub-block, 2 one per 16 values
#define SUB_MIN(F) (((F) == FMT_Q5_1 || (F) == FMT_Q4_K || (F) == FMT_Q5_K) ? 1 : (F) == FMT_Q2_K ? 2 : 0)

struct SubScales {
    float d0, d1, m0, m1;
};

// 4 bytes of a sub-block format's block: aligned where its blocks are a multiple of 4 bytes (rows start 16-byte
// aligned), else in 2-byte or (MXFP4's 17-byte blocks) 1-byte pieces.
template <int F>
__device__ __forceinline__ int sub_ld(const u8* p) {
    if (F == FMT_MXFP4) return ld_i32_a1(p);
    if (SUB_BYTES(F) % 4 == 0) return *(const int*)p;
    return ld_i32_a2(p);
}

// The block (or super-block) holding sub-block ib of a row; s: the sub-block's index in it.
template <int F>
__device__ __forceinline__ const u8* sub_base(const u8* row, int ib, int& s) {
    if (SUB_QK(F) == 256) {
        s = ib & 7;
        return row + (size_t)(ib >> 3) * SUB_BYTES(F);
    }
    s = 0;
    return row + (size_t)ib * SUB_BYTES(F);
}

// Bit k (k < 4) of b moved to bit 0 of byte k.
__device__ __forceinline__ int spread4(u32 b) {
    return (int)((b & 1) | ((b & 2) << 7) | ((b & 4) << 14) | ((b & 8) << 21));
}

// Four 4-bit indices (one per byte) looked up in a table of 16 signed bytes given as four little-endian words.
__device__ __forceinline__ int lut16(int idx, u32 t0, u32 t1, u32 t2, u32 t3) {
    const u32 sel = (idx & 0xF) | ((idx >> 4) & 0xF0) | ((idx >> 8) & 0xF00) | ((idx >> 12) & 0xF000);
    const u32 lo = __byte_perm(t0, t1, sel & 0x7777);
    const u32 hi = __byte_perm(t2, t3, sel & 0x7777);
    return (int)__byte_perm(lo, hi, 0x3210 | ((sel & 0x8888) >> 1));
}

// Half the E8M0 scale 2^(e - 127) (MXFP4's table is doubled), as ggml's ggml_e8m0_to_fp32_half.
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// Q3_K's 6-bit scale k (0..15) of the 12 packed bytes sc.
__device__ __forceinline__ int q3k_scale(const u8* sc, int k) {
    const int lo = k < 8 ? sc[k] & 0xF : sc[k - 8] >> 4;
    return lo | (((sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3) << 4);
}

// The first 16 bytes of a Q4_K/Q5_K super-block at b (d and dmin as f16, then the 12 bytes of 6-bit scales and
// minimums): one 16-byte load where b is 16-byte aligned, else four aligned words (the rows of these formats start
// 4-byte aligned and their super-blocks, 144 and 176 bytes, keep that).
__device__ __forceinline__ uint4 kq_header(const u8* b) {
    if (((size_t)b & 15) == 0) return *(const uint4*)b;
    const u32* w = (const u32*)b;
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Q4_K's and Q5_K's scales of sub-block s from the super-block's first 16 bytes h (kq_header): the scale d·sc and the
// minimum −dmin·m of ggml's get_scale_min_k4.
__device__ __forceinline__ SubScales kq_scales(const uint4 h, int s) {
    const int k = 8 * (s & 3);
    const u32 by = (h.y >> k) & 0xFF, bz = (h.z >> k) & 0xFF, bw = (h.w >> k) & 0xFF;  // bytes s & 3, 4 + .., 8 + ..
    const u32 sc = s < 4 ? by & 63 : (bw & 0xF) | ((by >> 6) << 4);
    const u32 m = s < 4 ? bz & 63 : (bw >> 4) | ((bz >> 6) << 4);
    SubScales r;
    r.d0 = r.d1 = half_to_float((u16)(h.x & 0xFFFF)) * (float)sc;
    r.m0 = r.m1 = -half_to_float((u16)(h.x >> 16)) * (float)m;
    return r;
}

// The eight words of Q4_K/Q5_K sub-block s (its low four bits) from the 32 quant bytes of its pair (a, b), as
// sub_word.
__device__ __forceinline__ void kq_words(const uint4 a, const uint4 b, int s, int (&w)[8]) {
    const int sh = 4 * (s & 1);
    const u32 v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; j++) w[j] = (int)((v[j] >> sh) & 0x0F0F0F0Fu);
}

// Q5_K's fifth bits of sub-block s (bit s of each of the 32 high-bit bytes a, b) added to its words, as sub_word.
__device__ __forceinline__ void q5k_high(const uint4 a, const uint4 b, int s, int (&w)[8]) {
    const u32 v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; j++) w[j] |= (int)(((v[j] >> s) & 0x01010101u) << 4);
}

// The lattice formats' words and scales, defined with the grids (after strata_iq_grids.h, below) and instantiated
// only for modules holding a lattice format.
template <int F>
__device__ __forceinline__ int iq_word(const u8* b, int s, int j);
template <int F>
__device__ __forceinline__ SubScales iq_scales(const u8* b, int s);

// Word j (values 4j .. 4j + 3 as signed bytes) of sub-block s of the block at b.
template <int F>
__device__ __forceinline__ int sub_word(const u8* b, int s, int j) {
    if constexpr (IS_IQ(F)) {
        return iq_word<F>(b, s, j);
    } else if (F == FMT_Q5_0 || F == FMT_Q5_1) {
        const u32 qh = (u32)sub_ld<F>(b + (F == FMT_Q5_0 ? 2 : 4));
        const int v = sub_ld<F>(b + (F == FMT_Q5_0 ? 6 : 8) + 4 * (j & 3));
        const int q = ((j < 4 ? v : v >> 4) & 0x0F0F0F0F) | (spread4((qh >> (4 * j)) & 0xF) << 4);
        return F == FMT_Q5_0 ? (int)__vsub4(q, 0x10101010) : q;
    } else if (F == FMT_Q4_K || F == FMT_Q5_K) {
        const u8* qs = b + (F == FMT_Q4_K ? 16 : 48) + 32 * (s >> 1);
        int q = (sub_ld<F>(qs + 4 * j) >> (4 * (s & 1))) & 0x0F0F0F0F;
        if (F == FMT_Q5_K) q |= ((sub_ld<F>(b + 16 + 4 * j) >> s) & 0x01010101) << 4;
        return q;
    } else if (F == FMT_Q6_K) {
        const int n = s >> 2, k = s & 3;
        const int lo = (sub_ld<F>(b + 64 * n + 32 * (k & 1) + 4 * j) >> (4 * (k >> 1))) & 0x0F0F0F0F;
        const int hi = (sub_ld<F>(b + 128 + 32 * n + 4 * j) >> (2 * k)) & 0x03030303;
        return (int)__vsub4(lo | (hi << 4), 0x20202020);
    } else if (F == FMT_Q2_K) {
        return (sub_ld<F>(b + 16 + 32 * (s >> 2) + 4 * j) >> (2 * (s & 3))) & 0x03030303;
    } else if (F == FMT_Q3_K) {
        const int q = (sub_ld<F>(b + 32 + 32 * (s >> 2) + 4 * j) >> (2 * (s & 3))) & 0x03030303;
        const int h = (sub_ld<F>(b + 4 * j) >> s) & 0x01010101;
        return (int)__vsub4(q, (h ^ 0x01010101) << 2);
    } else {  // IQ4_NL, IQ4_XS, MXFP4: 4-bit indices into a table, low nibbles the first 16 values
        const u8* qs = F == FMT_IQ4_NL ? b + 2 : F == FMT_MXFP4 ? b + 1 : b + 8 + 16 * s;
        const int v = sub_ld<F>(qs + 4 * (j & 3));
        const int idx = (j < 4 ? v : v >> 4) & 0x0F0F0F0F;
        // kvalues_mxfp4 and kvalues_iq4nl of ggml
        if (F == FMT_MXFP4) return lut16(idx, 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu);
        return lut16(idx, 0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u);
    }
}

// The scales of sub-block s of the block at b.
template <int F>
__device__ __forceinline__ SubScales sub_scales(const u8* b, int s) {
    if constexpr (IS_IQ(F)) return iq_scales<F>(b, s);
    SubScales r;
    r.m0 = r.m1 = 0.f;
    if (F == FMT_Q5_0 || F == FMT_IQ4_NL) {
        r.d0 = r.d1 = h2f(b);
    } else if (F == FMT_Q5_1) {
        r.d0 = r.d1 = h2f(b);
        r.m0 = r.m1 = h2f(b + 2);
    } else if (F == FMT_MXFP4) {
        r.d0 = r.d1 = e8m0_half(b[0]);
    } else if (F == FMT_Q4_K || F == FMT_Q5_K) {
        return kq_scales(kq_header(b), s);
    } else if (F == FMT_Q6_K) {
        const float d = h2f(b + 208);
        const signed char* sc = (const signed char*)(b + 192);
        r.d0 = d * (float)sc[2 * s];
        r.d1 = d * (float)sc[2 * s + 1];
    } else if (F == FMT_Q2_K) {
        const float d = h2f(b + 80), dm = h2f(b + 82);
        const int a = b[2 * s], c = b[2 * s + 1];
        r.d0 = d * (float)(a & 0xF);
        r.d1 = d * (float)(c & 0xF);
        r.m0 = -dm * (float)(a >> 4);
        r.m1 = -dm * (float)(c >> 4);
    } else if (F == FMT_Q3_K) {
        const float d = h2f(b + 108);
        r.d0 = d * (float)(q3k_scale(b + 96, 2 * s) - 32);
        r.d1 = d * (float)(q3k_scale(b + 96, 2 * s + 1) - 32);
    } else {  // IQ4_XS
        const int sh = *(const u16*)(b + 2);
        const int ls = ((b[4 + s / 2] >> (4 * (s & 1))) & 0xF) | (((sh >> (2 * s)) & 3) << 4);
        r.d0 = r.d1 = h2f(b) * (float)(ls - 32);
    }
    return r;
}

// Sub-block s of the block at b: its eight words into w (sub_word's values; the quants of a Q4_K/Q5_K super-block
// that starts 16-byte aligned in 16-byte loads) and its scales.
template <int F>
__device__ __forceinline__ SubScales sub_block(const u8* b, int s, int (&w)[8]) {
    if ((F == FMT_Q4_K || F == FMT_Q5_K) && ((size_t)b & 15) == 0) {
        const uint4* qp = (const uint4*)(b + (F == FMT_Q4_K ? 16 : 48) + 32 * (s >> 1));
        kq_words(qp[0], qp[1], s, w);
        if (F == FMT_Q5_K) q5k_high(((const uint4*)(b + 16))[0], ((const uint4*)(b + 16))[1], s, w);
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) w[j] = sub_word<F>(b, s, j);
    }
    return sub_scales<F>(b, s);
}

// The dot product of a decoded sub-block (w, sc) with one Q8 activation block.
template <int F>
__device__ __forceinline__ float sub_dot(const int (&w)[8], const SubScales& sc, const Q8& x) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        lo = __dp4a(w[j], x.qs[j], lo);
        hi = __dp4a(w[j + 4], x.qs[j + 4], hi);
    }
    float r = SUB_HALVES(F) ? x.d * (sc.d0 * (float)lo + sc.d1 * (float)hi) : x.d * sc.d0 * (float)(lo + hi);
    if (F == FMT_Q5_1) r += sc.m0 * x.s;  // as Q4_1 (ggml's Q8_1 sum)
    if (F == FMT_Q4_K || F == FMT_Q5_K) {
        // the minimum times the integer sum of the activation codes (as the CPU's Q8_K block sums: x.s is
        // rounded to f16, and the minimum's term nearly cancels the scale's)
        int sx = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) sx = __dp4a(0x01010101, x.qs[j], sx);
        r += sc.m0 * x.d * (float)sx;
    }
    if (SUB_MIN(F) == 2) {
        int sl = 0, sh = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            sl = __dp4a(0x01010101, x.qs[j], sl);
            sh = __dp4a(0x01010101, x.qs[j + 4], sh);
        }
        r += x.d * (sc.m0 * (float)sl + sc.m1 * (float)sh);
    }
    return r;
}

// One warp: acc[t] += row · x_t for the NT tokens (lane-strided partial sums; the caller reduces).
// `xq[t]` are the Q8 blocks of token t (block formats), `xf[t]` its f32 values (float formats).
template <int FMT, int NT>
__device__ __forceinline__ void row_dot(const u8* row, int cols, const Q8* const* xq, const float* const* xf, int lane,
                                        float* acc) {
    if (FMT == FMT_F32 || FMT == FMT_F16 || FMT == FMT_BF16) {
        for (int c = lane * 2; c < cols; c += 64) {
            float w0, w1;
            if (FMT == FMT_F32) {
                float2 w = *(const float2*)(row + (size_t)c * 4);
                w0 = w.x;
                w1 = w.y;
            } else if (FMT == FMT_F16) {
                u32 w = *(const u32*)(row + (size_t)c * 2);
                w0 = half_to_float((u16)(w & 0xffff));
                w1 = half_to_float((u16)(w >> 16));
            } else {
                u32 w = *(const u32*)(row + (size_t)c * 2);
                w0 = bf16_to_float((u16)(w & 0xffff));
                w1 = bf16_to_float((u16)(w >> 16));
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float2 x = *(const float2*)(xf[t] + c);
                acc[t] += w0 * x.x + w1 * x.y;
            }
        }
        return;
    }
    const int nb = cols / 32;
    if constexpr (IS_SUB(FMT)) {
        // each lane one 32-value sub-block at a time
        for (int ib = lane; ib < nb; ib += 32) {
            int s;
            const u8* b = sub_base<FMT>(row, ib, s);
            int w[8];
            const SubScales sc = sub_block<FMT>(b, s, w);
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] += sub_dot<FMT>(w, sc, xq[t][ib]);
        }
    } else {
#pragma unroll 4
        for (int ib = lane; ib < nb; ib += 32) {
            if (FMT == FMT_Q8_0) {
                const u8* b = row + (size_t)ib * 34;
                float d = h2f(b);
                int w[8];
#pragma unroll
                for (int j = 0; j < 8; j++) w[j] = ld_i32_a2(b + 2 + 4 * j);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const Q8& x = xq[t][ib];
                    int s = 0;
#pragma unroll
                    for (int j = 0; j < 8; j++) s = __dp4a(w[j], x.qs[j], s);
                    acc[t] += d * x.d * (float)s;
                }
            } else if (FMT == FMT_Q4_0) {
                const u8* b = row + (size_t)ib * 18;
                float d = h2f(b);
                int v[4];
#pragma unroll
                for (int j = 0; j < 4; j++) v[j] = ld_i32_a2(b + 2 + 4 * j);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const Q8& x = xq[t][ib];
                    int s = 0, sx = 0;
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        s = __dp4a(v[j] & 0x0F0F0F0F, x.qs[j], s);
                        s = __dp4a((v[j] >> 4) & 0x0F0F0F0F, x.qs[j + 4], s);
                        sx = __dp4a(0x01010101, x.qs[j], sx);
                        sx = __dp4a(0x01010101, x.qs[j + 4], sx);
                    }
                    acc[t] += d * x.d * (float)(s - 8 * sx);
                }
            } else {  // Q4_1
                const u8* b = row + (size_t)ib * 20;
                float d = h2f(b);
                float m = h2f(b + 2);
                int v[4];
#pragma unroll
                for (int j = 0; j < 4; j++) v[j] = *(const int*)(b + 4 + 4 * j);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const Q8& x = xq[t][ib];
                    int s = 0;
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        s = __dp4a(v[j] & 0x0F0F0F0F, x.qs[j], s);
                        s = __dp4a((v[j] >> 4) & 0x0F0F0F0F, x.qs[j + 4], s);
                    }
                    acc[t] += d * x.d * (float)s + m * x.s;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Staged block rows: a warp copies CB blocks of each of its NR rows into shared memory with 16-byte
// asynchronous copies (cp.async, sm_80+), then each lane takes pairs of blocks from there with aligned 32-bit
// reads (a pair of 18/34/20-byte blocks is 9/17/10 words, so the lanes' strides hit distinct banks). The weight
// bytes then cross the memory system in 16-byte pieces instead of 2-byte ones, and one read of a token's
// activation block serves all NR rows. Applies when the rows and activations are 16-byte aligned, the row stride
// `rb` is a multiple of 16 bytes and the row's block count is even (the usual case: cols % 256 == 0; the packed
// down parts of a PCIe split are padded to 16 bytes for it); a chunk's copy is rounded up to 16 bytes, which stays
// inside the stride. Otherwise `row_dot` runs.
#define CB 128
#define RPW 2
#define IS_BLOCK(F) ((F) >= FMT_Q8_0)
// the formats whose rows are staged (the sub-block formats are not)
#define IS_STAGED(F) ((F) >= FMT_Q8_0 && (F) <= FMT_Q4_1)
#define BLK_BYTES(F) ((F) == FMT_Q8_0 ? 34 : (F) == FMT_Q4_0 ? 18 : (F) == FMT_Q4_1 ? 20 : 16)
// Shared bytes a block of WARPS warps stages (each warp RPW rows of CB blocks).
#define STAGE_BYTES(F) (IS_STAGED(F) ? WARPS * RPW * CB * BLK_BYTES(F) : 16)

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Starts copying n16 16-byte units from global `src` to shared `dst` (both 16-byte aligned); done at stage_wait.
__device__ __forceinline__ void stage_async(u8* dst, const u8* src, int n16, int lane) {
#if __CUDA_ARCH__ >= 800
    const u32 d = smem_u32(dst);
    for (int i = lane; i < n16; i += 32)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + 16 * i), "l"(src + 16 * (size_t)i)
                     : "memory");
#else
    for (int i = lane; i < n16; i += 32) ((uint4*)dst)[i] = ((const uint4*)src)[i];
#endif
}

__device__ __forceinline__ void stage_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
    __syncwarp();
}

template <int FMT, int NT, int NR>
__device__ __forceinline__ bool can_stage(const u8* const* rows, int nb, size_t rb, const Q8* const* xq) {
    if (!IS_STAGED(FMT) || nb % 2 != 0 || rb % 16 != 0) return false;
    size_t a = 0;
#pragma unroll
    for (int r = 0; r < NR; r++) a |= (size_t)rows[r];
#pragma unroll
    for (int t = 0; t < NT; t++) a |= (size_t)xq[t];
    return (a & 15) == 0;
}

// Starts staging the first chunk (CBT blocks) of each of the NR rows (what rows_dot_staged<..., true, CBT>
// expects done).
template <int FMT, int NR, int CBT = CB>
__device__ __forceinline__ void stage_first(const u8* const* rows, int nb, int lane, u8* sm) {
    constexpr int BB = BLK_BYTES(FMT);
    const int n = min(CBT, nb);
#pragma unroll
    for (int r = 0; r < NR; r++) stage_async(sm + r * CBT * BB, rows[r], (n * BB + 15) / 16, lane);
}

// Two Q8 blocks (ib, ib + 1) of a token's activation, read as five 16-byte words.
struct XPair {
    float da, sa, db, sb;
    int qa[8], qb[8];
    int sxa, sxb;  // Q4_0: the sums of the quants (for the -8 offset)
};

template <int FMT>
__device__ __forceinline__ XPair load_xpair(const Q8* xq, int ib) {
    // two Q8 blocks (2 x 40 bytes): d, s, qs[8] | d, s, qs[8]
    const int4* xp = (const int4*)(xq + ib);
    const int4 x0 = xp[0], x1 = xp[1], x2 = xp[2], x3 = xp[3], x4 = xp[4];
    XPair x;
    x.da = __int_as_float(x0.x), x.sa = __int_as_float(x0.y);
    x.db = __int_as_float(x2.z), x.sb = __int_as_float(x2.w);
    const int qa[8] = {x0.z, x0.w, x1.x, x1.y, x1.z, x1.w, x2.x, x2.y};
    const int qb[8] = {x3.x, x3.y, x3.z, x3.w, x4.x, x4.y, x4.z, x4.w};
    x.sxa = 0, x.sxb = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        x.qa[j] = qa[j];
        x.qb[j] = qb[j];
        if (FMT == FMT_Q4_0) {
            x.sxa = __dp4a(0x01010101, qa[j], x.sxa);
            x.sxb = __dp4a(0x01010101, qb[j], x.sxb);
        }
    }
    return x;
}

// acc += a pair of weight blocks (w: its BB / 2 32-bit words as staged) · x.
template <int FMT>
__device__ __forceinline__ void pair_dot(const u32* w, const XPair& x, float& acc) {
    if (FMT == FMT_Q8_0) {
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            s0 = __dp4a((int)__funnelshift_r(w[j], w[j + 1], 16), x.qa[j], s0);
            s1 = __dp4a((int)w[9 + j], x.qb[j], s1);
        }
        acc += half_to_float((u16)(w[0] & 0xffff)) * x.da * (float)s0;
        acc += half_to_float((u16)(w[8] >> 16)) * x.db * (float)s1;
    } else if (FMT == FMT_Q4_0) {
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int v0 = (int)__funnelshift_r(w[j], w[j + 1], 16);
            const int v1 = (int)w[5 + j];
            s0 = __dp4a(v0 & 0x0F0F0F0F, x.qa[j], s0);
            s0 = __dp4a((v0 >> 4) & 0x0F0F0F0F, x.qa[j + 4], s0);
            s1 = __dp4a(v1 & 0x0F0F0F0F, x.qb[j], s1);
            s1 = __dp4a((v1 >> 4) & 0x0F0F0F0F, x.qb[j + 4], s1);
        }
        acc += half_to_float((u16)(w[0] & 0xffff)) * x.da * (float)(s0 - 8 * x.sxa);
        acc += half_to_float((u16)(w[4] >> 16)) * x.db * (float)(s1 - 8 * x.sxb);
    } else {  // Q4_1
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int v0 = (int)w[1 + j];
            const int v1 = (int)w[6 + j];
            s0 = __dp4a(v0 & 0x0F0F0F0F, x.qa[j], s0);
            s0 = __dp4a((v0 >> 4) & 0x0F0F0F0F, x.qa[j + 4], s0);
            s1 = __dp4a(v1 & 0x0F0F0F0F, x.qb[j], s1);
            s1 = __dp4a((v1 >> 4) & 0x0F0F0F0F, x.qb[j + 4], s1);
        }
        acc += half_to_float((u16)(w[0] & 0xffff)) * x.da * (float)s0 + half_to_float((u16)(w[0] >> 16)) * x.sa;
        acc += half_to_float((u16)(w[5] & 0xffff)) * x.db * (float)s1 + half_to_float((u16)(w[5] >> 16)) * x.sb;
    }
}

// acc[r][t] += rows[r] · x_t (lane-strided partial sums; the caller reduces). `sm`: this warp's NR*CBT*BB bytes
// (chunks of CBT blocks per row). FIRST: the first chunk's copies were started by `stage_first` (before the
// kernel's wait on the previous one). With more than two rows (one token) each row's words are read from
// shared memory just before its dot product, which keeps the registers of eight rows' pairs free.
template <int FMT, int NT, int NR, bool FIRST = false, int CBT = CB>
__device__ __forceinline__ void rows_dot_staged(const u8* const* rows, int nb, const Q8* const* xq, int lane,
                                                u8* sm, float (&acc)[NR][NT]) {
    constexpr int BB = BLK_BYTES(FMT);
    constexpr int PW = BB / 2;  // 32-bit words per pair of blocks
    for (int c0 = 0; c0 < nb; c0 += CBT) {
        const int n = min(CBT, nb - c0);
        __syncwarp();  // every lane is done with the previous chunk
        if (!FIRST || c0 > 0) {
#pragma unroll
            for (int r = 0; r < NR; r++)
                stage_async(sm + r * CBT * BB, rows[r] + (size_t)c0 * BB, (n * BB + 15) / 16, lane);
        }
        stage_wait();
#pragma unroll(NT == 1 ? 2 : 1)
        for (int p = lane; p < n / 2; p += 32) {
            const int ib = c0 + 2 * p;
            if (NT == 1 && NR > 2) {
                const XPair x = load_xpair<FMT>(xq[0], ib);
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    u32 w[PW];
                    const u32* s = (const u32*)(sm + r * CBT * BB) + p * PW;
#pragma unroll
                    for (int j = 0; j < PW; j++) w[j] = s[j];
                    pair_dot<FMT>(w, x, acc[r][0]);
                }
                continue;
            }
            u32 w[NR][PW];
#pragma unroll
            for (int r = 0; r < NR; r++) {
                const u32* s = (const u32*)(sm + r * CBT * BB) + p * PW;
#pragma unroll
                for (int j = 0; j < PW; j++) w[r][j] = s[j];
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const XPair x = load_xpair<FMT>(xq[t], ib);
#pragma unroll
                for (int r = 0; r < NR; r++) pair_dot<FMT>(w[r], x, acc[r][t]);
            }
        }
    }
}

// acc[r][t] += rows[r] · x_t, staged when it can be, else row by row. `rb`: bytes from one row to the next
// (at least row_bytes(FMT, cols)).
template <int FMT, int NT, int NR>
__device__ __forceinline__ void rows_dot(const u8* const* rows, int cols, size_t rb, const Q8* const* xq,
                                         const float* const* xf, int lane, u8* sm, float (&acc)[NR][NT]) {
    if constexpr (IS_STAGED(FMT)) {
        if (can_stage<FMT, NT, NR>(rows, cols / 32, rb, xq)) {
            rows_dot_staged<FMT, NT, NR>(rows, cols / 32, xq, lane, sm, acc);
            return;
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) row_dot<FMT, NT>(rows[r], cols, xq, xf, lane, acc[r]);
}

// ---------------------------------------------------------------------------------------------------------------
// Dense matrix-vector / small-batch products.
//
// Up to three matrices of one format and width are stacked (rows0 | rows1 | rows2): out[t*out_stride + r] for
// global row r. accumulate != 0 adds to out instead of writing. Each warp computes RPW adjacent rows.
// Grid: ceil(rows / (WARPS * RPW)) blocks of 32*WARPS threads (float formats: ceil(rows / RPW), mmv_float_body).
// Addresses of the RPW stacked rows r0.. of up to three matrices (rows0 | rows1 | the rest), `rb` bytes per row;
// rows past the end repeat the last row (computed, not written).
// The address of stacked row r (< rows0 + rows1 + the third matrix's rows) of up to three matrices, `rb` bytes per row.
__device__ __forceinline__ const u8* stacked_row(const u8* w0, const u8* w1, const u8* w2, int rows0, int rows1, int r,
                                                 size_t rb) {
    if (r < rows0) return w0 + (size_t)r * rb;
    if (r < rows0 + rows1) return w1 + (size_t)(r - rows0) * rb;
    return w2 + (size_t)(r - rows0 - rows1) * rb;
}

__device__ __forceinline__ void stacked_rows(const u8* w0, const u8* w1, const u8* w2, int rows0, int rows1, int rows,
                                             int r0, size_t rb, const u8* (&rp)[RPW]) {
#pragma unroll
    for (int j = 0; j < RPW; j++) rp[j] = stacked_row(w0, w1, w2, rows0, rows1, min(r0 + j, rows - 1), rb);
}

// Float formats: each block computes RPW adjacent rows, its WARPS warps splitting the columns (warp w takes the
// 64-column pieces w, w + WARPS, ...); the partial sums meet in shared memory. Grid: ceil(rows / RPW) blocks.
// (A warp per row pair left a small product such as an f32 router, 128 × 2048, to 16 blocks and its latency.)
// PRE: the kernel has not waited for the previous one yet (pdl_trigger only): the block's rows are asked of L2
// first, then it waits.
template <int FMT, int NT, bool PRE = false>
__device__ void mmv_float_body(const u8* w0, const u8* w1, const u8* w2, int rows0, int rows1, int rows2, int cols,
                               const float* xf, int x_stride, float* out, int out_stride, int accumulate) {
    __shared__ float part[WARPS][RPW][MAX_NT];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = blockIdx.x * RPW;
    const int rows = rows0 + rows1 + rows2;
    if (r0 >= rows) return;  // the same for the whole block
    const size_t rb = row_bytes(FMT, cols);
    const u8* rp[RPW];
    stacked_rows(w0, w1, w2, rows0, rows1, rows, r0, rb, rp);
    if (PRE) {
        const int lines = (int)((rb + 127) / 128);
#pragma unroll
        for (int j = 0; j < RPW; j++)
            for (int i = threadIdx.x; i < lines; i += blockDim.x)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(rp[j] + (size_t)i * 128));
        pdl_wait();
    }
    float acc[RPW][NT];
#pragma unroll
    for (int j = 0; j < RPW; j++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[j][t] = 0.f;
#pragma unroll 2
    for (int c = (warp * 32 + lane) * 2; c < cols; c += 64 * WARPS) {
        float wv[RPW][2];
#pragma unroll
        for (int j = 0; j < RPW; j++) {
            if (FMT == FMT_F32) {
                const float2 v = *(const float2*)(rp[j] + (size_t)c * 4);
                wv[j][0] = v.x;
                wv[j][1] = v.y;
            } else {
                const u32 v = *(const u32*)(rp[j] + (size_t)c * 2);
                wv[j][0] = FMT == FMT_F16 ? half_to_float((u16)(v & 0xffff)) : bf16_to_float((u16)(v & 0xffff));
                wv[j][1] = FMT == FMT_F16 ? half_to_float((u16)(v >> 16)) : bf16_to_float((u16)(v >> 16));
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float2 x = *(const float2*)(xf + (size_t)t * x_stride + c);
#pragma unroll
            for (int j = 0; j < RPW; j++) acc[j][t] += wv[j][0] * x.x + wv[j][1] * x.y;
        }
    }
#pragma unroll
    for (int j = 0; j < RPW; j++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = warp_sum(acc[j][t]);
            if (lane == 0) part[warp][j][t] = v;
        }
    __syncthreads();
    if (warp == 0 && lane < RPW * NT) {
        const int j = lane / NT, t = lane % NT;
        if (r0 + j < rows) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; w++) v += part[w][j][t];
            float* o = out + (size_t)t * out_stride + r0 + j;
            *o = accumulate ? *o + v : v;
        }
    }
    __syncthreads();  // `part` is free for the next tokens' call
}

// PRE: the kernel has not waited for the previous one yet (pdl_trigger only): the warp starts staging its rows'
// first chunk, then waits (weights are never written by kernels; the activations and `out` are).
template <int FMT, int NT, bool PRE = false>
__device__ void mmv_body(const u8* w0, const u8* w1, const u8* w2, int rows0, int rows1, int rows2, int cols,
                         const Q8* xq, const float* xf, int x_stride, float* out, int out_stride, int accumulate,
                         u8* stage) {
    if (!IS_BLOCK(FMT)) {
        mmv_float_body<FMT, NT, PRE>(w0, w1, w2, rows0, rows1, rows2, cols, xf, x_stride, out, out_stride,
                                     accumulate);
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x * WARPS + warp) * RPW;
    const int rows = rows0 + rows1 + rows2;
    if (r0 >= rows) return;
    const size_t rb = row_bytes(FMT, cols);
    const u8* rp[RPW];
    stacked_rows(w0, w1, w2, rows0, rows1, rows, r0, rb, rp);
    const Q8* xqs[NT];
    const float* xfs[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        xqs[t] = xq + (size_t)t * (x_stride / 32);
        xfs[t] = xf + (size_t)t * x_stride;
    }
    float acc[RPW][NT];
#pragma unroll
    for (int j = 0; j < RPW; j++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[j][t] = 0.f;
    u8* sm = stage + warp * (STAGE_BYTES(FMT) / WARPS);
    if constexpr (PRE && IS_STAGED(FMT)) {
        const bool staged = can_stage<FMT, NT, RPW>(rp, cols / 32, rb, xqs);
        if (staged) stage_first<FMT, RPW>(rp, cols / 32, lane, sm);
        pdl_wait();
        if (staged) rows_dot_staged<FMT, NT, RPW, true>(rp, cols / 32, xqs, lane, sm, acc);
        else rows_dot<FMT, NT, RPW>(rp, cols, rb, xqs, xfs, lane, sm, acc);
    } else {
        if (PRE) pdl_wait();
        rows_dot<FMT, NT, RPW>(rp, cols, rb, xqs, xfs, lane, sm, acc);
    }
#pragma unroll
    for (int j = 0; j < RPW; j++) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = warp_sum(acc[j][t]);
            if (lane == 0 && r0 + j < rows) {
                float* o = out + (size_t)t * out_stride + r0 + j;
                *o = accumulate ? *o + v : v;
            }
        }
    }
}

#define MMV_KERNEL(NAME, FMT)                                                                                   \
    extern "C" __global__ void NAME(const u8* __restrict__ w0, const u8* __restrict__ w1,                       \
                                    const u8* __restrict__ w2, int rows0, int rows1, int rows2,                \
                                    int cols, const Q8* xq, const float* xf, int x_stride, int nt, float* out,  \
                                    int out_stride, int accumulate) { pdl_entry();                                           \
        __shared__ __align__(16) u8 stage[STAGE_BYTES(FMT)];                                                    \
        for (int t0 = 0; t0 < nt; t0 += MAX_NT) {                                                               \
            const int n = min(MAX_NT, nt - t0);                                                                 \
            const Q8* q = xq + (size_t)t0 * (x_stride / 32);                                                   \
            const float* f = xf + (size_t)t0 * x_stride;                                                        \
            float* o = out + (size_t)t0 * out_stride;                                                           \
            switch (n) {                                                                                        \
                case 1: mmv_body<FMT, 1>(w0, w1, w2, rows0, rows1, rows2, cols, q, f, x_stride, o, out_stride, accumulate, stage); break; \
                case 2: mmv_body<FMT, 2>(w0, w1, w2, rows0, rows1, rows2, cols, q, f, x_stride, o, out_stride, accumulate, stage); break; \
                case 3: mmv_body<FMT, 3>(w0, w1, w2, rows0, rows1, rows2, cols, q, f, x_stride, o, out_stride, accumulate, stage); break; \
                case 4: mmv_body<FMT, 4>(w0, w1, w2, rows0, rows1, rows2, cols, q, f, x_stride, o, out_stride, accumulate, stage); break; \
                case 5: mmv_body<FMT, 5>(w0, w1, w2, rows0, rows1, rows2, cols, q, f, x_stride, o, out_stride, accumulate, stage); break; \
                case 6: mmv_body<FMT, 6>(w0, w1, w2, rows0, rows1, rows2, cols, q, f, x_stride, o, out_stride, accumulate, stage); break; \
                case 7: mmv_body<FMT, 7>(w0, w1, w2, rows0, rows1, rows2, cols, q, f, x_stride, o, out_stride, accumulate, stage); break; \
                default: mmv_body<FMT, 8>(w0, w1, w2, rows0, rows1, rows2, cols, q, f, x_stride, o, out_stride, accumulate, stage); break; \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    /* one token (decode): the registers of the 1-token body alone, so more warps fit on an SM */              \
    extern "C" __global__ void NAME##_t1(const u8* __restrict__ w0, const u8* __restrict__ w1,                  \
                                         const u8* __restrict__ w2, int rows0, int rows1, int rows2, int cols,  \
                                         const Q8* xq, const float* xf, int x_stride, int nt, float* out,       \
                                         int out_stride, int accumulate) { pdl_trigger();                                    \
        __shared__ __align__(16) u8 stage[STAGE_BYTES(FMT)];                                                    \
        mmv_body<FMT, 1, true>(w0, w1, w2, rows0, rows1, rows2, cols, xq, xf, x_stride, out, out_stride, accumulate, stage); \
    }

MMV_KERNEL(mmv_f32, FMT_F32)
MMV_KERNEL(mmv_f16, FMT_F16)
MMV_KERNEL(mmv_bf16, FMT_BF16)
MMV_KERNEL(mmv_q8_0, FMT_Q8_0)
MMV_KERNEL(mmv_q4_0, FMT_Q4_0)
MMV_KERNEL(mmv_q4_1, FMT_Q4_1)

// ---------------------------------------------------------------------------------------------------------------
// Prefill products on tensor cores (MMQ): out[t, r] (+)= Σ_c W[r, c] x[t, c] for the stacked rows of up to three
// block-format matrices (Q8_0, Q4_0, Q4_1 and the sub-block formats but Q2_K) and a chunk of tokens' Q8 rows, each
// 32-value block one int8 MMA (m16n8k32, s32 accumulation) whose integer sums are scaled per block as the one-row
// kernels do (Q8_0: d·dx·Σ; Q4_0: d·dx·Σ(q − 8)·qx, the same integer as their Σ − 8·Σqx; Q4_1: d·dx·Σ + m·sx); the
// blocks' scaled sums are added in another order than theirs, so results differ by rounding only. Block: MQ_WARPS
// warps, MQ_BM = 16 rows per warp by MQ_BN tokens (8 MMA column tiles); the wide kernels (`_w`) 2·MQ_BM, each warp's
// 16 rows and the 16 rows MQ_BM below them. Two loops: mq_core (MXFP4 and the lattice IQ formats; the others
// when the pipelined loop is off or the rows' alignment does not allow it) stages the tokens' Q8 blocks in shared
// memory MQ_KB blocks at a time ([block][token][12 ints]: 8 of quants, d, s; the 12-int stride keeps the B loads off
// each other's banks) and reads the weights straight into the A fragments; mq_core_pipe (below) copies
// weights and tokens into shared memory while the previous blocks multiply. The kernels of the pipelined formats
// (MQ_PIPE_FMT) take their shared memory as dynamic shared memory of the size the host's mq_smem gives (both loops'
// staging; MXFP4's and the lattice IQ formats' is static).
// Grid: (ceil(rows / MQ_BM), ceil(t / MQ_BN), nz column ranges: 1, or a split-K product's, see mmq_body); the wide
// kernels ceil(rows / (2·MQ_BM)) in x.
#define MQ_WARPS 4
#define MQ_BM (16 * MQ_WARPS)
#define MQ_BN 64
#define MQ_KB 8
#define MQ_XS 12
#define MQ_GPT (MQ_BN / MAX_NT)  // expert groups per tile of the tensor-core expert kernels

// The bias of mma_s8_16832_biased: 1.5 · 2^23 as a float's bits. A float with these bits plus an integer c,
// |c| < 2^22, is 1.5 · 2^23 + c exactly (its last mantissa bit is worth 1).
#define MQ_BIAS 0x4B400000

// D = A·B + MQ_BIAS (each of the four sums) for one m16n8k32 int8 tile (sm_80+; the host loads the kernels that use
// it only there, and older architectures compile a trap instead): the sums come out as the bits of floats
// 1.5 · 2^23 + Σ (|Σ| < 2^22: an int8 MMA's sum over one block is at most 32 · 128 · 128 in size), so that a float
// subtraction (mq_f) turns them into exact floats; the bias is the MMA's own accumulator input, kept in registers
// across the loop, where an integer add per sum did that before (same values).
__device__ __forceinline__ void mma_s8_16832_biased(int* d, const int* a, int b0, int b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(MQ_BIAS));
#else
    __trap();
#endif
}

// Row r's block ib of a block-format matrix as the A fragment's two 4-byte pieces of this thread (columns
// 4·tg .. 4·tg + 3 and 16 + 4·tg ..), with its scale d (and Q4_1's m).
template <int FMT>
__device__ __forceinline__ void mq_load_a(const u8* row, int ib, int tg, int& lo, int& hi, float& d, float& m,
                                          float& d1) {
    if constexpr (IS_SUB(FMT)) {
        // d: the first 16 values' scale, d1 the second's (SUB_HALVES), m the minimum (SUB_MIN == 1)
        int s;
        const u8* b = sub_base<FMT>(row, ib, s);
        const SubScales sc = sub_scales<FMT>(b, s);
        lo = sub_word<FMT>(b, s, tg);
        hi = sub_word<FMT>(b, s, tg + 4);
        d = sc.d0;
        d1 = sc.d1;
        m = sc.m0;
    } else if (FMT == FMT_Q8_0) {
        const u8* b = row + (size_t)ib * 34;
        d = h2f(b);
        lo = ld_i32_a2(b + 2 + 4 * tg);
        hi = ld_i32_a2(b + 2 + 16 + 4 * tg);
    } else if (FMT == FMT_Q4_0) {
        const u8* b = row + (size_t)ib * 18;
        d = h2f(b);
        const int v = ld_i32_a2(b + 2 + 4 * tg);
        lo = __vsub4(v & 0x0F0F0F0F, 0x08080808);
        hi = __vsub4((v >> 4) & 0x0F0F0F0F, 0x08080808);
    } else {  // Q4_1
        const u8* b = row + (size_t)ib * 20;
        d = h2f(b);
        m = h2f(b + 2);
        const int v = *(const int*)(b + 4 + 4 * tg);
        lo = v & 0x0F0F0F0F;
        hi = (v >> 4) & 0x0F0F0F0F;
    }
}

// The exact float of a biased MMA sum (mma_s8_16832_biased): one float subtraction.
__device__ __forceinline__ float mq_f(int c) { return __int_as_float(c) - 12582912.0f; }

// The column tiles (8 columns) that the tensor-core loops stage and multiply for `cols` leading columns that may
// hold tokens (1 ≤ cols ≤ MQ_BN): whole pairs of tiles, so that the loops check once per pair; the columns past
// `cols` are zeros (xrow < 0).
__device__ __forceinline__ int mq_live_tiles(int cols) { return min(MQ_BN / 8, 2 * ((cols + 15) / 16)); }
static_assert(MAX_NT == 8 && MQ_GPT * MAX_NT == MQ_BN && (MQ_BN / 8) % 2 == 0,
              "an expert tile's group is one column tile of 8, and the tiles come in pairs");

// One block's MMA into acc (this thread's rows g, g + 8 × columns 2·tg, 2·tg + 1 of one column tile), its integer
// sums scaled by the rows' d (da, db) and the columns' dx, plus Q4_1's m·sx.
// Formats of two scales per block (SUB_HALVES: da1, db1 scale the second 16 values) take two MMAs, each with the
// other half's A pieces zero. (The per-16 minimums of Q2_K have no tensor-core kernel.)
template <int FMT>
__device__ __forceinline__ void mq_mma_scaled(float* acc, const int* a, int b0, int b1, float da, float db, float ma,
                                              float mb, float da1, float db1, float dx0, float dx1, float sx0,
                                              float sx1) {
    static_assert(!IS_SUB(FMT) || SUB_MIN(FMT) < 2, "no tensor-core product for per-16 minimums");
    int c[4];
    if constexpr (IS_SUB(FMT) && SUB_HALVES(FMT)) {
        const int alo[4] = {a[0], a[1], 0, 0}, ahi[4] = {0, 0, a[2], a[3]};
        int c1[4];
        mma_s8_16832_biased(c, alo, b0, b1);
        mma_s8_16832_biased(c1, ahi, b0, b1);
        acc[0] += dx0 * (da * mq_f(c[0]) + da1 * mq_f(c1[0]));
        acc[1] += dx1 * (da * mq_f(c[1]) + da1 * mq_f(c1[1]));
        acc[2] += dx0 * (db * mq_f(c[2]) + db1 * mq_f(c1[2]));
        acc[3] += dx1 * (db * mq_f(c[3]) + db1 * mq_f(c1[3]));
        return;
    }
    mma_s8_16832_biased(c, a, b0, b1);
    acc[0] += da * dx0 * mq_f(c[0]);
    acc[1] += da * dx1 * mq_f(c[1]);
    acc[2] += db * dx0 * mq_f(c[2]);
    acc[3] += db * dx1 * mq_f(c[3]);
    if (FMT == FMT_Q4_1 || (IS_SUB(FMT) && SUB_MIN(FMT) == 1)) {
        acc[0] += ma * sx0;
        acc[1] += ma * sx1;
        acc[2] += mb * sx0;
        acc[3] += mb * sx1;
    }
}

// The MMA loop of the tensor-core products: acc[j][·] (and, GATED, accu: a second set of rows, the up rows of an
// expert's gate/up) over nb blocks of this thread's rows rp[0] (row g of the warp's 16) and rp[1] (row g + 8),
// against the Q8 rows xq + xrow[c] · xb (one per tile column c; xrow[c] < 0: a column of zeros). `xrow` is in
// shared memory, written and synced by the caller; `xs` is the block's staging. Only the first nj column tiles
// (mq_live_tiles) are staged, and with SKIP (the expert kernels, whose tiles of fewer than MQ_GPT groups leave
// column tiles without tokens) only they are multiplied, the later acc entries staying zero; the dense kernels
// multiply every tile (their tiles are full but the last; a check per pair cost them ~5% more instructions).
template <int FMT, bool GATED, bool SKIP>
__device__ __forceinline__ void mq_core(const u8* const (&rp)[2], const u8* const (&ru)[2], int nb, const Q8* xq,
                                        int xb, const int* xrow, int nj, int* xs, float (&acc)[MQ_BN / 8][4],
                                        float (&accu)[MQ_BN / 8][4]) {
    const int lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
#pragma unroll
    for (int j = 0; j < MQ_BN / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = accu[j][e] = 0.f;
    for (int kb0 = 0; kb0 < nb; kb0 += MQ_KB) {
        const int kn = min(MQ_KB, nb - kb0);
        __syncthreads();
        // the columns' Q8 blocks kb0 .. kb0 + kn into shared memory
        for (int i = threadIdx.x; i < kn * MQ_BN; i += 32 * MQ_WARPS) {
            const int kb = i / MQ_BN, c = i % MQ_BN;
            if (c >= 8 * nj) continue;
            int* dst = xs + (kb * MQ_BN + c) * MQ_XS;
            const int xr = xrow[c];
            if (xr >= 0) {
                const int* src = (const int*)(xq + (size_t)xr * xb + kb0 + kb);
#pragma unroll
                for (int q = 0; q < 8; q++) dst[q] = src[2 + q];
                dst[8] = src[0];
                if constexpr (FMT == FMT_Q4_K || FMT == FMT_Q5_K) {
                    // the exact d·Σq (as sub_dot: the K-quants' minimum nearly cancels their scale's term)
                    int sx = 0;
#pragma unroll
                    for (int q = 0; q < 8; q++) sx = __dp4a(0x01010101, src[2 + q], sx);
                    dst[9] = __float_as_int(__int_as_float(src[0]) * (float)sx);
                } else {
                    dst[9] = src[1];
                }
            } else {
#pragma unroll
                for (int q = 0; q < 10; q++) dst[q] = 0;
            }
        }
        __syncthreads();
        // this thread's B words (token g of a column tile, words tg and tg + 4) and its columns' d and s (tokens
        // 2·tg, 2·tg + 1)
        const int* xbt = xs + g * MQ_XS + tg;
        const int* xdt = xs + 2 * tg * MQ_XS;
        for (int kb = 0; kb < kn; kb++) {
            int a[4], au[4];
            float da, db, ma = 0.f, mb = 0.f, dua = 0.f, dub = 0.f, mua = 0.f, mub = 0.f;
            float da1 = 0.f, db1 = 0.f, dua1 = 0.f, dub1 = 0.f;
            mq_load_a<FMT>(rp[0], kb0 + kb, tg, a[0], a[2], da, ma, da1);
            mq_load_a<FMT>(rp[1], kb0 + kb, tg, a[1], a[3], db, mb, db1);
            if (GATED) {
                mq_load_a<FMT>(ru[0], kb0 + kb, tg, au[0], au[2], dua, mua, dua1);
                mq_load_a<FMT>(ru[1], kb0 + kb, tg, au[1], au[3], dub, mub, dub1);
            }
#pragma unroll
            for (int j = 0; j < MQ_BN / 8; j++) {
                if (SKIP && j % 2 == 0 && j > 0 && j >= nj) break;  // (nj is even: a check per pair of tiles)
                // offsets from this thread's words (constants of the unrolled loop but kb's); its outputs: rows g
                // (c0, c1) and g + 8 (c2, c3), columns j·8 + 2·tg and + 1
                const int o = (kb * MQ_BN + j * 8) * MQ_XS;
                const int b0 = xbt[o], b1 = xbt[o + 4];
                const float dx0 = __int_as_float(xdt[o + 8]), dx1 = __int_as_float(xdt[o + MQ_XS + 8]);
                const float sx0 = __int_as_float(xdt[o + 9]), sx1 = __int_as_float(xdt[o + MQ_XS + 9]);
                mq_mma_scaled<FMT>(acc[j], a, b0, b1, da, db, ma, mb, da1, db1, dx0, dx1, sx0, sx1);
                if (GATED)
                    mq_mma_scaled<FMT>(accu[j], au, b0, b1, dua, dub, mua, mub, dua1, dub1, dx0, dx1, sx0, sx1);
            }
        }
    }
}

// The pipelined MMA loop (the tensor-core formats but MXFP4, whose 17-byte blocks have no aligned words, and the
// lattice IQ formats, whose grid lookups ran 8-10% slower with it: IQ2_XS prefill on an H100, stop 50; STRATA_MMQ_PIPE,
// on unless compiled with 0): the weight rows' blocks and the tokens' Q8 blocks of MQ_KB blocks at a time (a
// super-block of the 256-value formats) are copied into shared memory by cp.async (sm_80+) while the previous MQ_KB
// blocks are multiplied, two stages in dynamic shared memory ([stage][NR rows × MQ_SA bytes | MQ_KB × MQ_BN × MQ_XS
// ints]; NR = MQ_BM, or 2·MQ_BM gate and up rows, or the wide kernels' two row ranges, for GATED). The weights are
// copied as they are in memory (mq_pipe_mode: 16-byte pieces, 4-byte ones, or — rows that start 2-byte aligned — the
// 4-byte words around each row's span, read from the row's offset in its first word) and read from shared memory into
// the fragments as mq_load_a reads them from global memory (an address keeps its remainder mod 4, so the same loads
// apply); a Q8 block as its 40 bytes (d, s, qs at ints 0, 1, 2..9 of its 12; for Q4_K/Q5_K its s is then replaced by
// d·Σq, mq_core's value). Arithmetic as mq_core's, in the same order: the same bits.
// rowp (shared, NR entries, written and synced by the caller): row i's first byte; mode: mq_pipe_mode's.
#ifndef STRATA_MMQ_PIPE
#define STRATA_MMQ_PIPE 1
#endif
#define MQ_PIPE_FMT(F) \
    ((F) == FMT_Q8_0 || (F) == FMT_Q4_0 || (F) == FMT_Q4_1 ||                                                  \
     (IS_SUB(F) && !IS_IQ(F) && (F) != FMT_MXFP4 && (F) != FMT_Q2_K))
// bytes per block: a 32-value block (a stage of MQ_KB of them may be cut short at a row's end), or a super-block of
// the 256-value formats
#define MQ_BB(F) ((F) == FMT_Q8_0 ? 34 : (F) == FMT_Q4_0 ? 18 : (F) == FMT_Q4_1 ? 20 : SUB_BYTES(F))
// bytes of a whole stage of one row: MQ_KB blocks, or one super-block
#define MQ_SPAN(F) (SUB_QK(F) == 256 ? SUB_BYTES(F) : MQ_KB * MQ_BB(F))
// the shared row stride of a stage: at least the span (plus 2 where rows may start 2-byte aligned), a multiple of 16
// bytes whose word count is 4 times an odd number, so that the fragment reads of the 8 rows × 4 lanes of a warp fall
// on 32 different banks (where the rows share their offset in the first word; rows 2 bytes apart there, as mode 2's
// alternating rows, can meet two to a bank in the upper halves of their 2-byte-aligned loads)
#define MQ_SA(F)                                                                                               \
    ((F) == FMT_Q8_0 ? 272 : (F) == FMT_Q6_K ? 240 : (F) == FMT_Q5_0 || (F) == FMT_Q5_1 ? 208                  \
     : (F) == FMT_Q4_1 || (F) == FMT_Q5_K || (F) == FMT_IQ4_NL ? 176 : 144)
// rows that start 2-byte aligned fit the stride with their offset
#define MQ_SHIFT_OK(F) (((MQ_SPAN(F) + 2 + 3) & ~3) <= MQ_SA(F))
// the K-quants' minimum term takes the exact d·Σq of each token block (as mq_core stages it)
#define MQ_EXACT_S(F) ((F) == FMT_Q4_K || (F) == FMT_Q5_K)
#define MQ_XBYTES (MQ_KB * MQ_BN * MQ_XS * 4)
#define MQ_STAGE(F, NR) ((NR) * MQ_SA(F) + MQ_XBYTES)

// One cp.async copy of N (4, 8 or 16) bytes from global to shared memory; 16-byte copies skip L1 (.cg: the weights
// are streamed once per block).
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
#if __CUDA_ARCH__ >= 800
    if constexpr (N == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src),
                     "n"(N));
#else
    __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}

// How the pipelined loop may copy rows whose starts are all congruent to `base_or` (the OR of the row bases and
// the row stride) modulo 16, nb blocks long: 16 (16-byte pieces: aligned, whole stages of whole pieces), 4 (4-byte
// pieces: each stage's span of every row a whole number of aligned words), 2 (rows 2-byte aligned: the words around
// each span, read from its offset), 0 (not pipelined: mq_core).
template <int FMT>
__device__ __forceinline__ int mq_pipe_mode(unsigned long long base_or, int nb) {
    if (!STRATA_MMQ_PIPE || !MQ_PIPE_FMT(FMT)) return 0;
    if (SUB_QK(FMT) == 256 && nb % MQ_KB != 0) return 0;  // a stage is a whole super-block
    if ((base_or & 15) == 0 && nb % MQ_KB == 0 && MQ_SPAN(FMT) % 16 == 0) return 16;
    if ((base_or & 3) == 0 && MQ_SPAN(FMT) % 4 == 0 && ((nb % MQ_KB) * MQ_BB(FMT)) % 4 == 0) return 4;
    if ((base_or & 1) == 0 && MQ_SHIFT_OK(FMT)) return 2;
    return 0;
}

// Byte offset in a row of the stage starting at block kb0 (a multiple of MQ_KB).
template <int FMT>
__device__ __forceinline__ size_t mq_stage_off(int kb0) {
    return (size_t)(kb0 / MQ_KB) * MQ_SPAN(FMT);
}

template <int FMT, bool GATED>
__device__ __forceinline__ void mq_pipe_load(const u8* const* rowp, int mode, int kb0, int nb, const Q8* xq, int xb,
                                             const int* xrow, int nj, u8* stage) {
    constexpr int NR = GATED ? 2 * MQ_BM : MQ_BM, SA = MQ_SA(FMT), NT = 32 * MQ_WARPS;
    const int kn = min(MQ_KB, nb - kb0);
    const int span = SUB_QK(FMT) == 256 ? MQ_SPAN(FMT) : kn * MQ_BB(FMT);  // bytes of each row in this stage
    const size_t off = mq_stage_off<FMT>(kb0);
    if (mode == 16) {
        const int ch = span / 16;
        for (int i = threadIdx.x; i < NR * ch; i += NT) {
            const int r = i / ch, c = i - r * ch;
            cp_async<16>(stage + r * SA + c * 16, rowp[r] + off + c * 16);
        }
    } else if (mode == 4) {
        const int ch = span / 4;
        for (int i = threadIdx.x; i < NR * ch; i += NT) {
            const int r = i / ch, c = i - r * ch;
            cp_async<4>(stage + r * SA + c * 4, rowp[r] + off + c * 4);
        }
    } else {
        // the aligned words that hold each row's span (it starts 0 or 2 bytes into its first word): no byte outside
        // them is read, and every word holds a byte of the row
        const int ch = (span + 2 + 3) / 4;
        for (int i = threadIdx.x; i < NR * ch; i += NT) {
            const int r = i / ch, c = i - r * ch;
            const size_t src = (size_t)(rowp[r] + off);
            if (c * 4 < (int)(src & 3) + span)
                cp_async<4>(stage + r * SA + c * 4, (const u8*)(src & ~(size_t)3) + c * 4);
        }
    }
    int* xs = (int*)(stage + NR * SA);
    for (int i = threadIdx.x; i < kn * MQ_BN; i += NT) {
        const int kb = i / MQ_BN, c = i % MQ_BN;
        if (c >= 8 * nj) continue;  // a column tile without tokens: neither staged nor multiplied
        int* dst = xs + (kb * MQ_BN + c) * MQ_XS;
        const int xr = xrow[c];
        if (xr >= 0) {
            const int* src = (const int*)(xq + (size_t)xr * xb + kb0 + kb);
#pragma unroll
            for (int q = 0; q < 5; q++) cp_async<8>(dst + 2 * q, src + 2 * q);
        } else {
#pragma unroll
            for (int q = 0; q < 10; q++) dst[q] = 0;
        }
    }
}

template <int FMT, bool GATED, bool SKIP>
__device__ __forceinline__ void mq_core_pipe(const u8* const* rowp, int mode, int nb, const Q8* xq, int xb,
                                             const int* xrow, int nj, u8* smem, float (&acc)[MQ_BN / 8][4],
                                             float (&accu)[MQ_BN / 8][4]) {
    constexpr int NR = GATED ? 2 * MQ_BM : MQ_BM, SA = MQ_SA(FMT), STAGE = MQ_STAGE(FMT, NR);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
    const int la = warp * 16 + g, lb = la + 8;  // this thread's rows in the tile
#pragma unroll
    for (int j = 0; j < MQ_BN / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = accu[j][e] = 0.f;
    const int ns = (nb + MQ_KB - 1) / MQ_KB;
    mq_pipe_load<FMT, GATED>(rowp, mode, 0, nb, xq, xb, xrow, nj, smem);
    cp_async_commit();
    for (int st = 0; st < ns; st++) {
        if (st + 1 < ns)
            mq_pipe_load<FMT, GATED>(rowp, mode, (st + 1) * MQ_KB, nb, xq, xb, xrow, nj,
                                     smem + ((st + 1) & 1) * STAGE);
        cp_async_commit();
        cp_async_wait<1>();  // this thread's copies of stage st are done
        const u8* as = smem + (st & 1) * STAGE;
        const int* xk0 = (const int*)(as + NR * SA);
        const int kn = min(MQ_KB, nb - st * MQ_KB);
        // a row's bytes start where its first byte sits in its first word (mode 2), else at the row's stride
        const size_t off = mq_stage_off<FMT>(st * MQ_KB);
        const auto row_at = [&](int r) { return as + r * SA + (mode == 2 ? (int)((size_t)(rowp[r] + off) & 3) : 0); };
        const u8* ra0 = row_at(la);
        const u8* rb0 = row_at(lb);
        const u8* ru0 = GATED ? row_at(MQ_BM + la) : ra0;
        const u8* ru1 = GATED ? row_at(MQ_BM + lb) : rb0;
        // this thread's B words (token g of a column tile, words tg and tg + 4 of its quants) and its columns'
        // d and s (tokens 2·tg, 2·tg + 1)
        const int* xbt = xk0 + g * MQ_XS + 2 + tg;
        const int* xdt = xk0 + 2 * tg * MQ_XS;
        if constexpr (MQ_EXACT_S(FMT)) {
            // each token block's s becomes d·Σq, the value mq_core stages (zero for the padding columns); each thread
            // takes the blocks it copied or zeroed itself (mq_pipe_load's mapping), visible to it after its wait
            int* xw = (int*)(as + NR * SA);
            for (int i = threadIdx.x; i < kn * MQ_BN; i += 32 * MQ_WARPS) {
                if (i % MQ_BN >= 8 * nj) continue;  // not staged
                int* x = xw + i * MQ_XS;
                int sx = 0;
#pragma unroll
                for (int q = 0; q < 8; q++) sx = __dp4a(0x01010101, x[2 + q], sx);
                x[1] = __float_as_int(__int_as_float(x[0]) * (float)sx);
            }
        }
        __syncthreads();  // everyone's copies (and fixed sums) are done
#pragma unroll
        for (int kb = 0; kb < MQ_KB; kb++) {
            if (kb >= kn) break;
            int a[4], au[4];
            float da, db, ma = 0.f, mb = 0.f, dua = 0.f, dub = 0.f, mua = 0.f, mub = 0.f;
            float da1 = 0.f, db1 = 0.f, dua1 = 0.f, dub1 = 0.f;
            mq_load_a<FMT>(ra0, kb, tg, a[0], a[2], da, ma, da1);
            mq_load_a<FMT>(rb0, kb, tg, a[1], a[3], db, mb, db1);
            if (GATED) {
                mq_load_a<FMT>(ru0, kb, tg, au[0], au[2], dua, mua, dua1);
                mq_load_a<FMT>(ru1, kb, tg, au[1], au[3], dub, mub, dub1);
            }
#pragma unroll
            for (int j = 0; j < MQ_BN / 8; j++) {
                if (SKIP && j % 2 == 0 && j > 0 && j >= nj) break;  // (nj is even: a check per pair of tiles)
                // offsets from this thread's words: constants of the unrolled loops
                const int o = (kb * MQ_BN + j * 8) * MQ_XS;
                const int b0 = xbt[o], b1 = xbt[o + 4];
                const float dx0 = __int_as_float(xdt[o]), dx1 = __int_as_float(xdt[o + MQ_XS]);
                const float sx0 = __int_as_float(xdt[o + 1]), sx1 = __int_as_float(xdt[o + MQ_XS + 1]);
                mq_mma_scaled<FMT>(acc[j], a, b0, b1, da, db, ma, mb, da1, db1, dx0, dx1, sx0, sx1);
                if (GATED)
                    mq_mma_scaled<FMT>(accu[j], au, b0, b1, dua, dub, mua, mub, dua1, dub1, dx0, dx1, sx0, sx1);
            }
        }
        __syncthreads();  // stage st's buffer is free for stage st + 2
    }
    cp_async_wait<0>();
}


// Blocks of 32 values per range of a split-K dense product over nb blocks in nz ranges (gridDim.z): whole stages
// (MQ_KB blocks, a super-block of the 256-value formats). The host chooses nz so that every range holds blocks
// ((nz − 1) · span < nb; ops.rs mq_kspan, mq_split_count).
__device__ __forceinline__ int mq_kspan(int nb, int nz) {
    const int per = (nb + nz - 1) / nz;
    return (per + MQ_KB - 1) / MQ_KB * MQ_KB;
}

// WIDE: 2·MQ_BM rows per block, each warp's 16 rows and the 16 rows MQ_BM below them against the same token
// fragments (the expert gate/up kernels' two matrices, here two row ranges of one): half the B loads per MMA, half the
// blocks. Each output's arithmetic as the narrow kernel's: the same bits.
// Split-K (gridDim.z = nz > 1; a grid of few blocks, see ops.rs mq_split_count): block z multiplies the column blocks
// [z·span, (z + 1)·span) (span = mq_kspan) as the one-range kernel multiplies all of them, in the same order, and
// writes its partial sums to out + z·nt·out_stride (the host passes the partials' scratch, out_stride = rows,
// accumulate = 0; mmf_sum_split adds the nz partials in z order). nz = 1: the one-range kernel.
template <int FMT, bool WIDE>
__device__ void mmq_body(const u8* w0, const u8* w1, const u8* w2, int rows0, int rows1, int rows2, int cols,
                         const Q8* xq, int x_stride, int nt, float* out, int out_stride, int accumulate) {
    constexpr int BM = WIDE ? 2 * MQ_BM : MQ_BM;
    __shared__ int xrow[MQ_BN];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
    const int rows = rows0 + rows1 + rows2;
    const int ra = blockIdx.x * BM + warp * 16 + g, rb = ra + 8;  // this thread's two rows (WIDE: and + MQ_BM)
    const int t0 = blockIdx.y * MQ_BN;
    const int nj = MQ_BN / 8;  // every column tile staged (the loop multiplies all of them: no SKIP)
    const size_t rbytes = row_bytes(FMT, cols);
    // this block's range of column blocks: all of them, or split-K range blockIdx.z (k0 a multiple of MQ_KB)
    int k0 = 0, nb = cols / 32;
    if (gridDim.z > 1) {
        const int span = mq_kspan(nb, gridDim.z);
        k0 = blockIdx.z * span;
        nb = min(span, nb - k0);
        out += (size_t)blockIdx.z * nt * out_stride;
        xq += k0;
    }
    const size_t koff = mq_stage_off<FMT>(k0);  // bytes of a row before block k0
    const auto row = [&](int r) {
        return stacked_row(w0, w1, w2, rows0, rows1, min(r, rows - 1), rbytes) + koff;
    };
    const u8* rp[2] = {row(ra), row(rb)};
    const u8* ru[2] = {WIDE ? row(ra + MQ_BM) : rp[0], WIDE ? row(rb + MQ_BM) : rp[1]};
    for (int c = threadIdx.x; c < MQ_BN; c += 32 * MQ_WARPS) xrow[c] = t0 + c < nt ? t0 + c : -1;
    float acc[MQ_BN / 8][4], accu[MQ_BN / 8][4];
    pdl_trigger();
    pdl_wait();
    if constexpr (MQ_PIPE_FMT(FMT)) {
        extern __shared__ __align__(16) int mq_dyn[];
        __shared__ const u8* rowp[BM];
        const int mode = mq_pipe_mode<FMT>((unsigned long long)w0 | (unsigned long long)w1 |
                                               (unsigned long long)w2 | (unsigned long long)rbytes |
                                               (unsigned long long)koff,
                                           nb);
        if (mode) {
            for (int i = threadIdx.x; i < BM; i += 32 * MQ_WARPS) rowp[i] = row(blockIdx.x * BM + i);
            __syncthreads();
            mq_core_pipe<FMT, WIDE, false>(rowp, mode, nb, xq, x_stride / 32, xrow, nj, (u8*)mq_dyn, acc, accu);
        } else {
            mq_core<FMT, WIDE, false>(rp, ru, nb, xq, x_stride / 32, xrow, nj, mq_dyn, acc, accu);
        }
    } else {
        __shared__ __align__(16) int xs[MQ_KB * MQ_BN * MQ_XS];
        mq_core<FMT, WIDE, false>(rp, ru, nb, xq, x_stride / 32, xrow, nj, xs, acc, accu);
    }
#pragma unroll
    for (int h = 0; h < (WIDE ? 2 : 1); h++) {
#pragma unroll
        for (int j = 0; j < MQ_BN / 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = (e < 2 ? ra : rb) + h * MQ_BM, tok = t0 + j * 8 + 2 * tg + (e & 1);
                if (r < rows && tok < nt) {
                    float* o = out + (size_t)tok * out_stride + r;
                    const float v = h ? accu[j][e] : acc[j][e];
                    *o = accumulate ? *o + v : v;
                }
            }
        }
    }
}

// Prefill products of float-format matrices (F32, F16, BF16: routers, small dense weights): out[t, r] (+)=
// Σ_c W[r, c] x[t, c] in f32 on CUDA cores, tiled MF_BM rows × MF_BN tokens per block of 256 threads through shared
// memory MF_BK columns at a time (each thread RT adjacent rows × 4 adjacent tokens, read from shared memory 16 bytes
// at a time: MF_BM = 16 · RT rows per block; RT = 4, or 1 in the `_r16` kernels for matrices of few rows). Sums in
// another order than the row kernel's: results differ by rounding only. Grid: (ceil(rows / MF_BM), ceil(t / MF_BN)).
#define MF_BN 64
#define MF_BK 32
template <int FMT, int RT>
__device__ void mmf_body(const u8* w0, const u8* w1, const u8* w2, int rows0, int rows1, int rows2, int cols,
                         const float* xf, int x_stride, int nt, float* out, int out_stride, int accumulate,
                         int kbeg = 0, int kend = 1 << 30) {
    kend = min(kend, cols);
    constexpr int MF_BM = 16 * RT;  // rows per block: RT adjacent ones per thread
    // values per thread and column step: weights, then tokens (thread tid takes elements tid + 256·i)
    constexpr int WN = MF_BM * MF_BK / 256, XN = MF_BN * MF_BK / 256;
    static_assert(WN * 256 == MF_BM * MF_BK && XN * 256 == MF_BN * MF_BK, "whole elements per thread");
    // rows 16-byte aligned: each thread reads its RT rows (RT = 4) and its 4 tokens as one 16-byte load each
    __shared__ __align__(16) float ws[MF_BK][MF_BM + 4];
    __shared__ __align__(16) float xs[MF_BK][MF_BN + 4];
    const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const int rows = rows0 + rows1 + rows2;
    const int r0 = blockIdx.x * MF_BM, t0 = blockIdx.y * MF_BN;
    const size_t rb = row_bytes(FMT, cols);
    float acc[RT][4];
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
    // a column step's operands, loaded into registers one step ahead of their products (all loads of a step in
    // flight at once; the products' order over the columns is unchanged)
    float wv[WN], xv[XN];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < WN; i++) {
            const int e = tid + 256 * i, rr = e / MF_BK, c = e % MF_BK, r = r0 + rr, col = k0 + c;
            float v = 0.f;
            if (r < rows && col < kend) {
                const u8* row = stacked_row(w0, w1, w2, rows0, rows1, r, rb);
                if (FMT == FMT_F32) v = ((const float*)row)[col];
                else if (FMT == FMT_F16) v = half_to_float(((const u16*)row)[col]);
                else v = bf16_to_float(((const u16*)row)[col]);
            }
            wv[i] = v;
        }
#pragma unroll
        for (int i = 0; i < XN; i++) {
            const int e = tid + 256 * i, tt = e / MF_BK, c = e % MF_BK, col = k0 + c;
            xv[i] = t0 + tt < nt && col < kend ? xf[(size_t)(t0 + tt) * x_stride + col] : 0.f;
        }
    };
    pdl_trigger();
    pdl_wait();
    if (kbeg < kend) fetch(kbeg);
    for (int k0 = kbeg; k0 < kend; k0 += MF_BK) {
        __syncthreads();  // the previous step's products are done with the tiles
#pragma unroll
        for (int i = 0; i < WN; i++) {
            const int e = tid + 256 * i;
            ws[e % MF_BK][e / MF_BK] = wv[i];
        }
#pragma unroll
        for (int i = 0; i < XN; i++) {
            const int e = tid + 256 * i;
            xs[e % MF_BK][e / MF_BK] = xv[i];
        }
        __syncthreads();
        if (k0 + MF_BK < kend) fetch(k0 + MF_BK);
#pragma unroll 8
        for (int c = 0; c < MF_BK; c++) {
            // this thread's rows ty·RT .. + RT − 1 and tokens 4·tx .. + 3 of the tile
            float a[RT], b[4];
            if constexpr (RT == 4) {
                const float4 av = *(const float4*)&ws[c][4 * ty];
                a[0] = av.x, a[1] = av.y, a[2] = av.z, a[3] = av.w;
            } else {
#pragma unroll
                for (int i = 0; i < RT; i++) a[i] = ws[c][RT * ty + i];
            }
            const float4 bv = *(const float4*)&xs[c][4 * tx];
            b[0] = bv.x, b[1] = bv.y, b[2] = bv.z, b[3] = bv.w;
#pragma unroll
            for (int i = 0; i < RT; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < RT; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int r = r0 + RT * ty + i, tok = t0 + 4 * tx + j;
            if (r < rows && tok < nt) {
                float* o = out + (size_t)tok * out_stride + r;
                *o = accumulate ? *o + acc[i][j] : acc[i][j];
            }
        }
}

#define MMF_KERNEL(NAME, FMT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                      \
        const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2, int rows0, int rows1,    \
        int rows2, int cols, const Q8* xq, const float* xf, int x_stride, int nt, float* out, int out_stride,      \
        int accumulate) {                                                                                        \
        mmf_body<FMT, 4>(w0, w1, w2, rows0, rows1, rows2, cols, xf, x_stride, nt, out, out_stride, accumulate);   \
    }                                                                                                            \
    /* few rows (a router): 16 rows per block, four times the blocks */                                          \
    extern "C" __global__ void __launch_bounds__(256) NAME##_r16(                                                \
        const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2, int rows0, int rows1,    \
        int rows2, int cols, const Q8* xq, const float* xf, int x_stride, int nt, float* out, int out_stride,      \
        int accumulate) {                                                                                        \
        mmf_body<FMT, 1>(w0, w1, w2, rows0, rows1, rows2, cols, xf, x_stride, nt, out, out_stride, accumulate);   \
    }
MMF_KERNEL(mmf_f32, FMT_F32)
MMF_KERNEL(mmf_f16, FMT_F16)
MMF_KERNEL(mmf_bf16, FMT_BF16)

// Split-K form of the tiled float product for matrices of few rows and many columns (a router over a prefill chunk:
// 128 rows × 2,048 columns gave 16-64 blocks of 64 serial column steps, latency-bound at 0.25 ms per layer on the
// H200). Block (x, y, z) computes rows x·MF_BM.., tokens y·MF_BN.. over columns [z·kspan, (z + 1)·kspan) as mmf_body
// and writes its partial sums to part[(z · nt + tok) · rows + r]; mmf_sum_split adds the gridDim.z partials of
// each output in z order (deterministic; another order than the one-block kernels': rounding only).
#define MMF_SPLIT_KERNEL(NAME, FMT)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) NAME(const u8* __restrict__ w, int rows, int cols,          \
                                                           const float* xf, int x_stride, int nt, int kspan,      \
                                                           float* part) {                                         \
        const int z = blockIdx.z;                                                                                 \
        mmf_body<FMT, 4>(w, nullptr, nullptr, rows, 0, 0, cols, xf, x_stride, nt, part + (size_t)z * nt * rows,  \
                         rows, 0, z * kspan, z * kspan + kspan);                                                  \
    }
MMF_SPLIT_KERNEL(mmf_split_f32, FMT_F32)
MMF_SPLIT_KERNEL(mmf_split_f16, FMT_F16)
MMF_SPLIT_KERNEL(mmf_split_bf16, FMT_BF16)

// out[tok · out_stride + r] (+)= Σ_z part[(z · nt + tok) · rows + r], z = 0 .. nz − 1 in order. Grid: ceil(nt · rows /
// 256); block: 256 threads.
extern "C" __global__ void mmf_sum_split(const float* part, int nz, int nt, int rows, float* out, int out_stride,
                                         int accumulate) {
    pdl_entry();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nt * rows) return;
    const int tok = i / rows, r = i % rows;
    float s = 0.f;
    for (int z = 0; z < nz; z++) s += part[(size_t)z * nt * rows + i];
    float* o = out + (size_t)tok * out_stride + r;
    *o = accumulate ? *o + s : s;
}

#define MMQ_KERNEL(NAME, FMT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MQ_WARPS) NAME(                                            \
        const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2, int rows0, int rows1,    \
        int rows2, int cols, const Q8* xq, const float* xf, int x_stride, int nt, float* out, int out_stride,      \
        int accumulate) {                                                                                        \
        mmq_body<FMT, false>(w0, w1, w2, rows0, rows1, rows2, cols, xq, x_stride, nt, out, out_stride, accumulate); \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * MQ_WARPS) NAME##_w(                                        \
        const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2, int rows0, int rows1,    \
        int rows2, int cols, const Q8* xq, const float* xf, int x_stride, int nt, float* out, int out_stride,      \
        int accumulate) {                                                                                        \
        mmq_body<FMT, true>(w0, w1, w2, rows0, rows1, rows2, cols, xq, x_stride, nt, out, out_stride, accumulate); \
    }
MMQ_KERNEL(mmq_q8_0, FMT_Q8_0)
MMQ_KERNEL(mmq_q4_0, FMT_Q4_0)
MMQ_KERNEL(mmq_q4_1, FMT_Q4_1)

// ---------------------------------------------------------------------------------------------------------------
// A Q8 block of 32 values held one per lane by a whole warp: `v` is this lane's value, `lane` its index (the norms'
// single-row path and the attention's output).
__device__ __forceinline__ void quantize_block_warp(float v, Q8* out, int lane) {
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = amax != 0.f ? 127.0f / amax : 0.f;
    int q = __float2int_rn(v * id);
    // pack 4 lanes' bytes into one int
    int b = q & 0xff;
    int b1 = __shfl_down_sync(0xffffffffu, b, 1);
    int b2 = __shfl_down_sync(0xffffffffu, b, 2);
    int b3 = __shfl_down_sync(0xffffffffu, b, 3);
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if ((lane & 3) == 0) out->qs[lane / 4] = b | (b1 << 8) | (b2 << 16) | (b3 << 24);
    if (lane == 0) {
        out->d = f16_round(d);
        out->s = f16_round(d * (float)sum);
    }
}

// A Q8 block of 32 values held 4 per lane by 8 consecutive lanes (lane % 8 = sub holds values 4·sub .. 4·sub + 3) of
// a warp whose lanes all call this; `live` is the same for the 8 lanes of a block (lanes with it false take part in the
// shuffles with zeros and write nothing): quantize_block_warp's arithmetic (an exact maximum and integer sum), so its
// bytes.
__device__ __forceinline__ void quantize_block_8(const float (&v)[4], bool live, Q8* out, int sub) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    const float id = amax != 0.f ? 127.0f / amax : 0.f;
    int packed = 0, sum = 0;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const int q = __float2int_rn(v[c] * id);
        sum += q;
        packed |= (q & 0xff) << (8 * c);
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (!live) return;
    out->qs[sub] = packed;
    if (sub == 0) {
        out->d = f16_round(d);
        out->s = f16_round(d * (float)sum);
    }
}

// n_blocks Q8 blocks of x's values, 8 threads per block (thread i: values 4i .. 4i + 3, of block i / 8;
// quantize_block_8), so that a warp takes four blocks with 16-byte loads. Grid: ceil(n_blocks / 32); block: 256.
extern "C" __global__ void __launch_bounds__(256) quantize_q8(const float* x, Q8* out, int n_blocks) {
    pdl_entry();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t b = i / 8;
    const bool live = b < (size_t)n_blocks;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (live) {
        if (((size_t)x & 15) == 0) {
            const float4 f = ((const float4*)x)[i];
            v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
        } else {
#pragma unroll
            for (int c = 0; c < 4; c++) v[c] = x[4 * i + c];
        }
    }
    quantize_block_8(v, live, out + (live ? b : 0), (int)(i % 8));
}

// Q8 block of 32 values held by one thread (the same arithmetic as quantize_block_warp).
__device__ __forceinline__ void quantize_block_thread(const float (&v)[32], Q8* out) {
    float amax = 0.f;
#pragma unroll
    for (int c = 0; c < 32; c++) amax = fmaxf(amax, fabsf(v[c]));
    const float d = amax / 127.0f;
    const float id = amax != 0.f ? 127.0f / amax : 0.f;
    int sum = 0;
#pragma unroll
    for (int q = 0; q < 8; q++) {
        int packed = 0;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int qv = __float2int_rn(v[4 * q + c] * id);
            sum += qv;
            packed |= (qv & 0xff) << (8 * c);
        }
        out->qs[q] = packed;
    }
    out->d = f16_round(d);
    out->s = f16_round(d * (float)sum);
}

// RMSNorm of `t` rows of `n` values with weight w, then Q8 quantization: out = x / sqrt(mean(x^2) + eps) * w.
// One block of NORM_THREADS threads per row; n % 32 == 0, n <= NORM_MAX. Phase 1: every thread takes 4
// consecutive values at a time (16-byte reads), keeps them in shared memory (padded: value i at i + i / 32) and
// sums their squares; phase 2: thread j scales the 32 values of Q8 block j and quantizes them itself (its
// weights read before phase 1). Rows must be 16-byte aligned.
// y != null: the previous MoE layer's combine first, x[row] += Σ_r (flag[p] ? cw[p] * y[p] : 0) (+ cpu[row] when
// cpu != null) over the routing entries p = row * k + r in rank order, written back to x (the residual stream).
// The MoE combine of four values at column c of token `row`: v += Σ_r (fl[r] ? cws[r] * y[row * k + r][c..c+4]
// : 0) (+ cpu[row][c..c+4]), summed in rank order before the add (the CPU path's order). Predicated loads from
// the shared flags, unrolled so that the rows' reads are in flight together.
__device__ __forceinline__ void combine4(float (&v)[4], const float* y, const float* cpu, const int* fl,
                                         const float* cws, int row, int k, int n, int c) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
    for (int r = 0; r < k; r++) {
        const int p = row * k + r;
        if (!fl[r]) continue;
        const float cwp = cws[r];
        const float4 b = *(const float4*)(y + (size_t)p * n + c);
        acc[0] += cwp * b.x;
        acc[1] += cwp * b.y;
        acc[2] += cwp * b.z;
        acc[3] += cwp * b.w;
    }
    if (cpu) {
        const float4 b = *(const float4*)(cpu + (size_t)row * n + c);
        acc[0] += b.x;
        acc[1] += b.y;
        acc[2] += b.z;
        acc[3] += b.w;
    }
#pragma unroll
    for (int q = 0; q < 4; q++) v[q] += acc[q];
}

// The combine's per-entry flags and router weights of token `row` into shared `fl` / `cws` (threads 0..k-1;
// nothing without a combine), then a block barrier.
__device__ __forceinline__ void load_combine_entries(const float* y, const float* cw, const int* flag, int row, int k,
                                                     int* fl, float* cws) {
    if (y && (int)threadIdx.x < k) {
        const int p = row * k + threadIdx.x;
        fl[threadIdx.x] = flag[p];
        cws[threadIdx.x] = cw[p];
    }
    __syncthreads();
}

#define NORM_THREADS 256
#define NORM_MAX 8192
extern "C" __global__ void rms_norm_q8(float* x, const float* w, float eps, int n, float* out, Q8* outq,
                                       const float* y, const float* cw, const int* flag, const float* cpu, int k) {
    pdl_trigger();
    __shared__ float xs[NORM_MAX + NORM_MAX / 32];
    __shared__ double red[NORM_THREADS / 32];
    __shared__ float cws[32];  // the combine's weights, 0 where the GPU did not compute the entry
    __shared__ int fl[32];
    const int row = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // the norm's weights (no kernel writes them) while the previous kernel finishes
    const bool mine = tid < n / 32;  // n / 32 <= NORM_THREADS: one Q8 block per thread at most
    float wv[32];
    if (mine) {
        const float4* w4 = (const float4*)(w + 32 * tid);
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const float4 b = w4[q];
            wv[4 * q] = b.x, wv[4 * q + 1] = b.y, wv[4 * q + 2] = b.z, wv[4 * q + 3] = b.w;
        }
    }
    pdl_wait();
    load_combine_entries(y, cw, flag, row, k, fl, cws);
    float* xr = x + (size_t)row * n;
    double ss = 0.0;
    for (int i = 4 * tid; i < n; i += 4 * NORM_THREADS) {
        const float4 a = *(const float4*)(xr + i);
        float v[4] = {a.x, a.y, a.z, a.w};
        if (y) {
            combine4(v, y, cpu, fl, cws, row, k, n, i);
            *(float4*)(xr + i) = make_float4(v[0], v[1], v[2], v[3]);
        }
#pragma unroll
        for (int q = 0; q < 4; q++) {
            xs[i + q + (i + q) / 32] = v[q];
            ss += (double)v[q] * (double)v[q];
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (!mine) return;
    double tot = 0.0;
#pragma unroll
    for (int i = 0; i < NORM_THREADS / 32; i++) tot += red[i];
    const float scale = 1.0f / sqrtf((float)(tot / (double)n) + eps);
    float v[32];
#pragma unroll
    for (int c = 0; c < 32; c++) v[c] = xs[33 * tid + c] * scale * wv[c];
    float4* o4 = (float4*)(out + (size_t)row * n + 32 * tid);
#pragma unroll
    for (int q = 0; q < 8; q++) o4[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    quantize_block_thread(v, outq + (size_t)row * (n / 32) + tid);
}

// One slice of a row for the sliced norms (rms_norm_q8_cluster calls both, rms_norm_q8_warps norm_slice_sum, so
// their sums are the same): the slice's m values at xr (combined first where y != null, see combine4, and written
// back) copied to xs, and this thread's sum of their squares (double; thread `tid` of `nthr` takes the 4-value groups
// 4·tid, 4·tid + 4·nthr, ... in order) reduced over its warp by the butterfly. c0: the slice's first column in the
// row.
__device__ __forceinline__ double norm_slice_sum(float* xr, float* xs, int m, int tid, int nthr, const float* y,
                                                 const float* cpu, const int* fl, const float* cws, int row, int k,
                                                 int n, int c0) {
    double ss = 0.0;
    for (int i = 4 * tid; i < m; i += 4 * nthr) {
        const float4 a = *(const float4*)(xr + i);
        float v[4] = {a.x, a.y, a.z, a.w};
        if (y) {
            combine4(v, y, cpu, fl, cws, row, k, n, c0 + i);
            *(float4*)(xr + i) = make_float4(v[0], v[1], v[2], v[3]);
        }
        *(float4*)(xs + i) = make_float4(v[0], v[1], v[2], v[3]);
#pragma unroll
        for (int q = 0; q < 4; q++) ss += (double)v[q] * (double)v[q];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    return ss;
}

// The slice's output: its nblk Q8 blocks of normalized values (xs · scale · ws, 32 per block) into out (f32) and outq,
// block j by warp j mod nwarps (quantize_block_warp).
__device__ __forceinline__ void norm_slice_out(const float* xs, const float* ws, float scale, float* out, Q8* outq,
                                               int nblk, int warp, int nwarps, int lane) {
    for (int j = warp; j < nblk; j += nwarps) {
        const float v = xs[32 * j + lane] * scale * ws[32 * j + lane];
        out[32 * j + lane] = v;
        quantize_block_warp(v, outq + j, lane);
    }
}

// The same RMSNorm (+ combine) + Q8 over a cluster of NORM_CLUSTER blocks per row (sm_90+): one block cannot
// use the card, and this small kernel sat on every layer's critical path twice. Block r of a row's cluster takes
// Q8 blocks [r * nb / C, (r + 1) * nb / C) of the row (nb = n / 32): it does the combine of that slice, keeps
// it in shared memory with the norm's weights (loaded before waiting on the previous kernel), sums its squares
// (double), then reads the other blocks' sums through distributed shared memory; its warps scale and quantize
// one Q8 block per pass (quantize_block_warp: the same arithmetic as quantize_block_thread). Grid: (C, t);
// block: NORM_CLUSTER_THREADS threads; n % 32 == 0, n <= NORM_MAX, rows 16-byte aligned.
#define NORM_CLUSTER 8
#define NORM_CLUSTER_THREADS 128
#define NORM_SLICE_MAX (NORM_MAX / NORM_CLUSTER + 32)
#if __CUDA_ARCH__ >= 900
#define CLUSTER_DIMS __cluster_dims__(NORM_CLUSTER, 1, 1)
#else
#define CLUSTER_DIMS
#endif
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ void cluster_sync_all() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// The double at `p` (this block's shared memory) in the shared memory of cluster block `rank`.
__device__ __forceinline__ double ld_cluster_f64(const double* p, unsigned rank) {
    double v = 0.0;
#if __CUDA_ARCH__ >= 900
    unsigned a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(a) : "memory");
#endif
    return v;
}
extern "C" __global__ void CLUSTER_DIMS rms_norm_q8_cluster(float* x, const float* w, float eps, int n, float* out,
                                                           Q8* outq, const float* y, const float* cw,
                                                           const int* flag, const float* cpu, int k) {
#if __CUDA_ARCH__ >= 900
    pdl_trigger();
    __shared__ __align__(16) float xs[NORM_SLICE_MAX];
    __shared__ __align__(16) float ws[NORM_SLICE_MAX];
    __shared__ double red[NORM_CLUSTER_THREADS / 32];
    __shared__ double part;
    __shared__ float cws[32];
    __shared__ int fl[32];
    const unsigned rank = cluster_rank();
    const int row = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int nb = n / 32;
    const int b0 = (int)rank * nb / NORM_CLUSTER, b1 = ((int)rank + 1) * nb / NORM_CLUSTER;
    const int e0 = 32 * b0, m = 32 * (b1 - b0);  // this block's elements: [e0, e0 + m)
    // the norm's weights (no kernel writes them) while the previous kernel finishes
    for (int i = 4 * tid; i < m; i += 4 * NORM_CLUSTER_THREADS)
        *(float4*)(ws + i) = *(const float4*)(w + e0 + i);
    pdl_wait();
    load_combine_entries(y, cw, flag, row, k, fl, cws);
    const double ss =
        norm_slice_sum(x + (size_t)row * n + e0, xs, m, tid, NORM_CLUSTER_THREADS, y, cpu, fl, cws, row, k, n, e0);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (tid == 0) {
        double t = 0.0;
#pragma unroll
        for (int i = 0; i < NORM_CLUSTER_THREADS / 32; i++) t += red[i];
        part = t;
    }
    cluster_sync_all();  // every block's `part` is written
    double tot = 0.0;
#pragma unroll
    for (int r = 0; r < NORM_CLUSTER; r++) tot += ld_cluster_f64(&part, r);
    cluster_sync_all();  // no block leaves while another still reads its `part`
    const float scale = 1.0f / sqrtf((float)(tot / (double)n) + eps);
    norm_slice_out(xs, ws, scale, out + (size_t)row * n + e0, outq + (size_t)row * nb + b0, b1 - b0, warp,
                   NORM_CLUSTER_THREADS / 32, lane);
#endif
}

// The cluster kernel's arithmetic on prefill chunks (more than 8 rows, the host's MAX_NT; sm_90+ where the cluster
// kernel runs): the same bits from one block of NORM_CLUSTER warps per row, warp r doing slice r. Lane l of warp r
// plays thread 32·v + l of the cluster's block r for each of its NORM_CLUSTER_THREADS / 32 warps v in turn
// (norm_slice_sum: the same groups, order and butterfly), the warp sums added in v order from zero and the slices'
// sums in rank order; a virtual warp with no group in the slice adds an exact zero, so it is skipped. The output is
// quantized 8 lanes per Q8 block (quantize_block_8: quantize_block_warp's bytes). A block of 256 threads and the row
// in dynamic shared memory (4·n bytes) let eight rows share an SM, where `rms_norm_q8_rows` (stop 54; 1,024 threads
// and a static 32 KiB buffer per row) ran one: 16.1 and 35.6 µs for a 512-row chunk's two norms on an H100, the
// second one's MoE combine reading 8 expert rows per row at 1.2 TB/s; this kernel 6.9 and 19.2 µs (stop 55). Grid: (t); block: NORM_CLUSTER · 32 threads;
// dynamic shared memory 4·n bytes; n % 32 == 0, n <= NORM_MAX, rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(NORM_CLUSTER * 32)
    rms_norm_q8_warps(float* x, const float* w, float eps, int n, float* out, Q8* outq, const float* y,
                      const float* cw, const int* flag, const float* cpu, int k) {
    pdl_trigger();
    extern __shared__ __align__(16) float xs_dyn[];
    __shared__ double parts[NORM_CLUSTER];
    __shared__ float cws[32];
    __shared__ int fl[32];
    const int rank = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x, nb = n / 32;
    const int b0 = rank * nb / NORM_CLUSTER, b1 = (rank + 1) * nb / NORM_CLUSTER;
    const int e0 = 32 * b0, m = 32 * (b1 - b0);  // this slice's elements: [e0, e0 + m)
    float* xs = xs_dyn + e0;
    pdl_wait();
    load_combine_entries(y, cw, flag, row, k, fl, cws);
    double part = 0.0;
#pragma unroll
    for (int v = 0; v < NORM_CLUSTER_THREADS / 32; v++) {
        if (4 * 32 * v >= m) break;  // this virtual warp and the later ones hold no group: their sums are zeros
        part += norm_slice_sum(x + (size_t)row * n + e0, xs, m, 32 * v + lane, NORM_CLUSTER_THREADS, y, cpu, fl, cws,
                               row, k, n, e0);
    }
    if (lane == 0) parts[rank] = part;
    __syncthreads();
    double tot = 0.0;
#pragma unroll
    for (int r = 0; r < NORM_CLUSTER; r++) tot += parts[r];
    const float scale = 1.0f / sqrtf((float)(tot / (double)n) + eps);
    // the slice's Q8 blocks, four per pass of the warp: lane l takes values 4·(l % 8) .. + 3 of block l / 8 (every
    // lane makes the same number of passes: the shuffles need the whole warp)
    const int sub = lane % 8, nblk = b1 - b0;
    for (int jb = lane / 8; jb < ((nblk + 3) & ~3); jb += 4) {
        const bool live = jb < nblk;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (live) {
            const int c = 32 * jb + 4 * sub;
            const float4 a = *(const float4*)(xs + c);
            const float4 g = *(const float4*)(w + e0 + c);
            v[0] = a.x * scale * g.x, v[1] = a.y * scale * g.y, v[2] = a.z * scale * g.z, v[3] = a.w * scale * g.w;
            *(float4*)(out + (size_t)row * n + e0 + c) = make_float4(v[0], v[1], v[2], v[3]);
        }
        quantize_block_8(v, live, outq + (size_t)row * nb + b0 + (live ? jb : 0), sub);
    }
}

// One head's RMSNorm in place by a warp (x: hd values, w: hd weights): the sum of squares in double, lane l taking
// values l, l + 32, ... in order, then the butterfly; scale 1 / sqrt(mean + eps) as the CPU path's norm.
__device__ __forceinline__ void head_norm_warp(float* x, const float* w, int hd, float eps, int lane) {
    double ss = 0.0;
    for (int j = lane; j < hd; j += 32) ss += (double)x[j] * (double)x[j];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float scale = 1.0f / sqrtf((float)(ss / hd) + eps);
    for (int j = lane; j < hd; j += 32) x[j] = __fmul_rn(__fmul_rn(x[j], scale), w[j]);
}

// Before RoPE, for the architectures that have them (one block of QKV_PREP_THREADS threads per token row of
// qkv, in place): the projection biases `bias` (qd + 2 * kvd values laid out as the row, [q | k | v]; null =
// none) are added, then the queries and keys are RMS-normalized — mode 1: each head's hd values with the
// weights qn / kn (hd each, Qwen3); mode 2: the whole q (qd) and k (kvd) parts with weights of those widths
// (OLMoE); mode 0: no norm. Sums of squares in double, scale 1 / sqrt(mean + eps) as the CPU path's norm.
#define QKV_PREP_THREADS 256
extern "C" __global__ void qkv_prep(float* qkv, const float* bias, const float* qn, const float* kn, int mode,
                                    int n_head, int n_head_kv, int hd, float eps) {
    pdl_entry();
    __shared__ double red[QKV_PREP_THREADS / 32];
    const int qd = n_head * hd, kvd = n_head_kv * hd, n = qd + 2 * kvd;
    float* row = qkv + (size_t)blockIdx.x * n;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if (bias) {
        for (int j = tid; j < n; j += QKV_PREP_THREADS) row[j] = __fadd_rn(row[j], bias[j]);
        __syncthreads();
    }
    if (mode == 1) {
        // one warp per head, q heads then k heads
        for (int h = warp; h < n_head + n_head_kv; h += QKV_PREP_THREADS / 32)
            head_norm_warp(row + (size_t)h * hd, h < n_head ? qn : kn, hd, eps, lane);  // k heads follow the q heads
    } else if (mode == 2) {
        for (int part = 0; part < 2; part++) {
            float* x = row + (part ? qd : 0);
            const int m = part ? kvd : qd;
            const float* wv = part ? kn : qn;
            double ss = 0.0;
            for (int j = tid; j < m; j += QKV_PREP_THREADS) ss += (double)x[j] * (double)x[j];
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0) red[warp] = ss;
            __syncthreads();
            double tot = 0.0;
            for (int i = 0; i < QKV_PREP_THREADS / 32; i++) tot += red[i];
            const float scale = 1.0f / sqrtf((float)(tot / m) + eps);
            for (int j = tid; j < m; j += QKV_PREP_THREADS) x[j] = __fmul_rn(__fmul_rn(x[j], scale), wv[j]);
            __syncthreads();  // red is reused by the k part
        }
    }
}

// One RoPE rotation of (a, b) by (cos, sin) r, with rounded products (no fused multiply-add: the CPU path's
// arithmetic).
__device__ __forceinline__ float2 rotate(float a, float b, float2 r) {
    return make_float2(__fsub_rn(__fmul_rn(a, r.x), __fmul_rn(b, r.y)), __fadd_rn(__fmul_rn(a, r.y), __fmul_rn(b, r.x)));
}

// RoPE on q and k — neox = 0: adjacent pairs (llama.cpp's "normal" mode); neox = 1: the pairs (i, i + n_rot/2)
// of each head (GPT-NeoX mode) — then q rounded to f16 precision into `q`,
// (rounded products, no fused multiply-add: the CPU path's arithmetic),
// k and v stored as f16 into the KV cache at positions pos0 + i.
// qkv: t rows of (n_head + 2*n_head_kv) * hd values [q | k | v]; cs: t * (n_rot/2) (cos, sin) pairs.
// `pos` points at pos0 (a device scalar, so a captured CUDA graph replays at any position).
// Grid: (t, any); block: 128 threads.
// The locals rope_store and rope_store_q8 start with, for their block's row i = blockIdx.x: pos0, the q and k/v
// widths, the row's q|k|v values (src) and (cos, sin) pairs (c), this thread's first index (j0) and stride (js).
#define ROPE_ROW_LOCALS                                                                                           \
    const int i = blockIdx.x;                                                                                     \
    const int pos0 = *pos;                                                                                        \
    const int qd = n_head * hd, kvd = n_head_kv * hd;                                                             \
    const float* src = qkv + (size_t)i * (qd + 2 * kvd);                                                          \
    const float2* c = cs + (size_t)i * (n_rot / 2);                                                               \
    const int j0 = blockIdx.y * blockDim.x + threadIdx.x, js = gridDim.y * blockDim.x;

extern "C" __global__ void rope_store(const float* qkv, const float2* cs, int n_head, int n_head_kv, int hd,
                                      int n_rot, const int* pos, float* q, u16* kcache, u16* vcache, int neox) {
    pdl_entry();
    ROPE_ROW_LOCALS
    if (neox) {
        // pair j of head h: (i, i + n_rot/2) for i = j % (hd/2) < n_rot/2; the unrotated tail is copied in pairs
        const int half = n_rot / 2, hh = hd / 2;
        u16* kc = kcache + (size_t)(pos0 + i) * kvd;
        u16* vc = vcache + (size_t)(pos0 + i) * kvd;
        for (int j = j0; j < (qd + kvd) / 2; j += js) {
            const bool is_k = j >= qd / 2;
            const int jj = is_k ? j - qd / 2 : j;
            const int h = jj / hh, r = jj % hh;
            const float* x = src + (is_k ? qd : 0) + (size_t)h * hd;
            int pa, pb;
            float2 o;
            if (r < half) {
                pa = r;
                pb = r + half;
                o = rotate(x[pa], x[pb], c[r]);
            } else {
                pa = n_rot + 2 * (r - half);
                pb = pa + 1;
                o = make_float2(x[pa], x[pb]);
            }
            if (is_k) {
                kc[h * hd + pa] = float_to_half(o.x);
                kc[h * hd + pb] = float_to_half(o.y);
            } else {
                q[(size_t)i * qd + h * hd + pa] = f16_round(o.x);
                q[(size_t)i * qd + h * hd + pb] = f16_round(o.y);
            }
        }
        for (int j = j0; j < kvd; j += js) vc[j] = float_to_half(src[qd + kvd + j]);
        return;
    }
    // q
    for (int j = j0; j < qd / 2; j += js) {
        int h = (2 * j) / hd, p = (2 * j) % hd;  // p even
        const float a = src[h * hd + p], b = src[h * hd + p + 1];
        float2 o = make_float2(a, b);
        if (p < n_rot) o = rotate(a, b, c[p / 2]);
        q[(size_t)i * qd + h * hd + p] = f16_round(o.x);
        q[(size_t)i * qd + h * hd + p + 1] = f16_round(o.y);
    }
    u16* kc = kcache + (size_t)(pos0 + i) * kvd;
    u16* vc = vcache + (size_t)(pos0 + i) * kvd;
    for (int j = j0; j < kvd / 2; j += js) {
        int h = (2 * j) / hd, p = (2 * j) % hd;
        const float a = src[qd + h * hd + p], b = src[qd + h * hd + p + 1];
        float2 o = make_float2(a, b);
        if (p < n_rot) o = rotate(a, b, c[p / 2]);
        kc[h * hd + p] = float_to_half(o.x);
        kc[h * hd + p + 1] = float_to_half(o.y);
    }
    for (int j = j0; j < kvd; j += js) vc[j] = float_to_half(src[qd + kvd + j]);
}

// qkv_prep (modes 0 and 1) and rope_store in one launch, with their bits: one warp per head of a token row (the
// n_head q heads, then the n_head_kv k heads, then the n_head_kv v heads, as the row lays them out) adds the head's
// biases (`bias` as qkv_prep takes it; null = none), RMS-normalizes a q or k head with qn / kn (mode 1: qkv_prep's
// sums of squares in double, in its order), rotates it (rope_store's pairs and rounded products), and writes q
// rounded to f16 precision into `q`, k and v as f16 into the cache at position pos0 + i. `qkv` is read, not
// rewritten. hd <= QRS_MAX_HD, even. Grid: (t, ceil((n_head + 2 * n_head_kv) / QRS_WARPS)); block: 32 * QRS_WARPS.
#define QRS_WARPS 4
#define QRS_MAX_HD 256
extern "C" __global__ void __launch_bounds__(32 * QRS_WARPS)
    qkv_rope_store(const float* qkv, const float* bias, const float* qn, const float* kn, int mode, float eps,
                   const float2* cs, int n_head, int n_head_kv, int hd, int n_rot, const int* pos, float* q,
                   u16* kcache, u16* vcache, int neox) {
    pdl_entry();
    __shared__ float xs[QRS_WARPS][QRS_MAX_HD];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y * QRS_WARPS + warp, i = blockIdx.x;
    if (h >= n_head + 2 * n_head_kv) return;  // a whole warp; the block never syncs
    const int pos0 = *pos;
    const int qd = n_head * hd, kvd = n_head_kv * hd;
    const float* src = qkv + (size_t)i * (qd + 2 * kvd) + (size_t)h * hd;
    const float* b = bias ? bias + (size_t)h * hd : nullptr;
    if (h >= n_head + n_head_kv) {
        u16* vc = vcache + (size_t)(pos0 + i) * kvd + (size_t)(h - n_head - n_head_kv) * hd;
        for (int j = lane; j < hd; j += 32) vc[j] = float_to_half(b ? __fadd_rn(src[j], b[j]) : src[j]);
        return;
    }
    float* x = xs[warp];
    for (int j = lane; j < hd; j += 32) x[j] = b ? __fadd_rn(src[j], b[j]) : src[j];
    __syncwarp();
    if (mode == 1) head_norm_warp(x, h < n_head ? qn : kn, hd, eps, lane);
    __syncwarp();
    const float2* c = cs + (size_t)i * (n_rot / 2);
    const bool is_k = h >= n_head;
    float* qo = q + (size_t)i * qd + (size_t)h * hd;
    u16* ko = kcache + (size_t)(pos0 + i) * kvd + (size_t)(h - n_head) * hd;
    const int half = n_rot / 2;
    for (int r = lane; r < hd / 2; r += 32) {
        int pa, pb;
        float2 o;
        if (neox) {
            // pairs (r, r + n_rot/2) below n_rot/2; the unrotated tail in adjacent pairs
            pa = r < half ? r : n_rot + 2 * (r - half);
            pb = r < half ? r + half : pa + 1;
            o = r < half ? rotate(x[pa], x[pb], c[r]) : make_float2(x[pa], x[pb]);
        } else {
            pa = 2 * r;
            pb = pa + 1;
            o = pa < n_rot ? rotate(x[pa], x[pb], c[r]) : make_float2(x[pa], x[pb]);
        }
        if (is_k) {
            ko[pa] = float_to_half(o.x);
            ko[pb] = float_to_half(o.y);
        } else {
            qo[pa] = f16_round(o.x);
            qo[pb] = f16_round(o.y);
        }
    }
}

// Element `e` of one head of k after RoPE (x: the head's hd values; the same rounded products as rope_store).
__device__ __forceinline__ float rope_elem(const float* x, const float2* c, int e, int n_rot, int neox) {
    if (e >= n_rot) return x[e];
    if (neox) {
        const int half = n_rot / 2;
        return e < half ? rotate(x[e], x[e + half], c[e]).x : rotate(x[e - half], x[e], c[e - half]).y;
    }
    const int p = e & ~1;
    const float2 o = rotate(x[p], x[p + 1], c[p / 2]);
    return (e & 1) ? o.y : o.x;
}

// rope_store for a Q8_0 KV cache (`--kv-type q8_0`): q after RoPE as the CPU's Q8_0 path takes it (not rounded to
// f16: the one-block and split kernels quantize it per 32 values as the CPU does; the tensor-core kernels round it
// to f16 as they load it, as they do rope_store's); k (after RoPE) and v stored as ggml
// Q8_0 blocks of 32 values (KvRows<1>), quantized as quantize_block_warp quantizes activations — d = max|x| / 127
// rounded to f16, codes round(x · 127 / max|x|) to nearest even: the CPU cache's encoding (kv.rs encode_q8_0), so the
// cache holds the same bytes as the CPU's for the same k and v. One warp per block of 32 values; hd % 32 == 0.
// Grid: (t, any); block: 128 threads.
extern "C" __global__ void rope_store_q8(const float* qkv, const float2* cs, int n_head, int n_head_kv, int hd,
                                         int n_rot, const int* pos, float* q, u8* kcache, u8* vcache, int neox) {
    pdl_entry();
    ROPE_ROW_LOCALS
    for (int j = j0; j < qd; j += js) {
        const int h = j / hd, e = j % hd;
        q[(size_t)i * qd + j] = rope_elem(src + (size_t)h * hd, c, e, n_rot, neox);
    }
    const int lane = threadIdx.x % 32, nb = kvd / 32;
    const size_t rb = (size_t)nb * 34;
    for (int w = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32; w < 2 * nb; w += gridDim.y * (blockDim.x / 32)) {
        const bool is_v = w >= nb;
        const int b = is_v ? w - nb : w, d = b * 32 + lane, h = d / hd, e = d % hd;
        const float v = is_v ? src[qd + kvd + d] : rope_elem(src + qd + (size_t)h * hd, c, e, n_rot, neox);
        const float amax = warp_max(fabsf(v));
        const float id = amax != 0.f ? 127.0f / amax : 0.f;
        u8* blk = (is_v ? vcache : kcache) + (size_t)(pos0 + i) * rb + (size_t)b * 34;
        blk[2 + lane] = (u8)(signed char)__float2int_rn(v * id);
        if (lane == 0) *(u16*)blk = float_to_half(amax / 127.0f);
    }
}

// The maximum of `v` over the block (every thread gets it), through `red` (one float per warp, shared); ends with a
// barrier, so `red` may be reused.
__device__ __forceinline__ float block_max(float v, float* red) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    v = warp_max(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < nw; w++) v = fmaxf(v, red[w]);
    __syncthreads();
    return v;
}

// KV cache rows, by type: KVQ 0 = f16 (kvd halves per position), 1 = ggml Q8_0 (kvd / 32 blocks of 34 bytes per
// position: an f16 scale d and 32 signed bytes, value = d · q; a head's hd values (hd % 32 == 0) are hd / 32 whole
// blocks). `at(p, kh, hd)` is the first byte of K/V head kh at position p.
template <int KVQ>
struct KvRows {
    const u8* base;
    size_t rb;  // bytes per position
    __device__ __forceinline__ KvRows(const void* b, int kvd)
        : base((const u8*)b), rb(KVQ ? (size_t)(kvd / 32) * 34 : (size_t)kvd * 2) {}
    __device__ __forceinline__ const u8* at(size_t p, int kh, int hd) const {
        return base + p * rb + (KVQ ? (size_t)kh * (hd / 32) * 34 : (size_t)kh * hd * 2);
    }
    // value `col` of the head row at `r` (from `at`)
    __device__ __forceinline__ float val(const u8* r, int col) const {
        if (KVQ) {
            const u8* b = r + (col / 32) * 34;
            return h2f(b) * (float)(signed char)b[2 + col % 32];
        }
        return half_to_float(((const u16*)r)[col]);
    }
};

// The query of a Q8_0 cache's scores, quantized with the CPU path's rule (attend_q8_0: quantize_q8 per 32
// values, as llama.cpp's vector kernels quantize it for a quantized K): `qs` (hd f32 values, shared) into codes
// `qq` (hd / 4 ints of 4 codes) and scales `qd` (hd / 32, f16-rounded), both shared; hd <= 256 (qq and qd are
// fixed arrays of the callers; the backend refuses a Q8_0 cache for larger heads). One warp per 32-value block;
// the caller syncs after.
__device__ __forceinline__ void quantize_query_q8(const float* qs, int hd, int* qq, float* qd) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    for (int b = warp; b < hd / 32; b += nw) {
        const float v = qs[b * 32 + lane];
        const float amax = warp_max(fabsf(v));
        const float id = amax != 0.f ? 127.0f / amax : 0.f;
        const int c = __float2int_rn(v * id) & 0xff;
        const int c1 = __shfl_down_sync(0xffffffffu, c, 1), c2 = __shfl_down_sync(0xffffffffu, c, 2);
        const int c3 = __shfl_down_sync(0xffffffffu, c, 3);
        if ((lane & 3) == 0) qq[b * 8 + lane / 4] = c | (c1 << 8) | (c2 << 16) | (c3 << 24);
        if (lane == 0) qd[b] = f16_round(amax / 127.0f);
    }
}

// The attention score q · k (unscaled) of a Q8_0 key row `kr` (hd / 32 blocks) and the query's Q8_0 codes `qq` and
// scales `qd` (quantize_query_q8): Σ over blocks of d_k · d_q · Σ q·k (integer sums), the CPU's order (the Q8_0
// row kernel's scalar reference).
__device__ __forceinline__ float att_score_q8(const int* qq, const float* qd, const u8* kr, int hd) {
    float s = 0.f;
    for (int b = 0; b < hd / 32; b++) {
        const u8* blk = kr + b * 34;
        int isum = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) isum = __dp4a(ld_i32_a2(blk + 2 + 4 * j), qq[b * 8 + j], isum);
        s += h2f(blk) * qd[b] * (float)isum;
    }
    return s;
}

// The attention score q · k of one position (unscaled): f16 keys `kr`, f32 query `qs` (shared); `vec`: 16-byte
// key reads (hd % 8 == 0 and 16-byte aligned rows). The CPU path's order of rounded products and sums
// (model/llama.rs dot_f32): eight partial sums, then a fixed tree.
__device__ __forceinline__ float att_score(const float* qs, const u16* kr, int hd, bool vec) {
    if (vec) {
        float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int d = 0; d < hd; d += 8) {
            const uint4 kv = *(const uint4*)(kr + d);
            const u32 wds[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                a[2 * j] = __fadd_rn(a[2 * j], __fmul_rn(qs[d + 2 * j], half_to_float((u16)(wds[j] & 0xffff))));
                a[2 * j + 1] =
                    __fadd_rn(a[2 * j + 1], __fmul_rn(qs[d + 2 * j + 1], half_to_float((u16)(wds[j] >> 16))));
            }
        }
        return __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(a[0], a[4]), __fadd_rn(a[1], a[5])), __fadd_rn(a[2], a[6])),
                         __fadd_rn(a[3], a[7]));
    }
    float s = 0.f;
    for (int d = 0; d < hd; d++) s = __fadd_rn(s, __fmul_rn(qs[d], half_to_float(kr[d])));
    return s;
}

// Causal grouped-query attention of t query rows over the KV cache (f16), position of row i = pos0 + i.
// q: t * n_head * hd (f16-rounded by rope_store for an f16 cache); out: t * n_head * hd. Over an f16 cache the
// probabilities are rounded to f16 before the product with V (as llama.cpp over an F16 cache; KVQ 1: below). Grid: (n_head, t); block: 128 threads; dynamic shared
// memory: at least (pos0 + t) floats for the scores + hd floats for q. `pos` points at pos0 (device scalar).
// Scores: one position per thread (16-byte K reads when hd % 8 == 0 and the rows are 16-byte aligned), with the
// CPU path's order of rounded products and sums (model/llama.rs), as is the product with V.
// outq != null (hd % 32 == 0): the output rows are also written as Q8 blocks (the input of the output product).
// window > 0: each row attends to its last `window` positions only (sliding-window layers); sinks != null: head h's
// softmax also counts exp(sinks[h]) in its denominator (gpt-oss's attention sinks, one logit per query head).
// KVQ 1 (`attention_q8`): a Q8_0 cache (KvRows), the query (unrounded: rope_store_q8) quantized to Q8_0 for the
// scores with the CPU path's rule (att_score_q8), the probabilities kept in f32 and V dequantized, as the CPU's
// Q8_0 path does (its sums are taken in another order, so the results differ by rounding).
template <int KVQ>
__device__ void attention_body(const float* q, const void* kc, const void* vc, int n_head, int n_head_kv, int hd,
                               const int* pos, float scale, float* out, Q8* outq, int window, const float* sinks) {
    pdl_entry();
    extern __shared__ float sh[];
    const int pos0 = *pos;
    const int h = blockIdx.x, i = blockIdx.y;
    const int n_all = pos0 + i + 1;
    // a sliding window: the last `window` positions only (scores indexed from the first of them)
    const int first = window > 0 ? max(0, n_all - window) : 0;
    const int n = n_all - first;
    const int kvd = n_head_kv * hd;
    const KvRows<KVQ> kr(kc, kvd), vr(vc, kvd);
    const u16* kcache = (const u16*)kc + (size_t)first * kvd;
    const u16* vcache = (const u16*)vc + (size_t)first * kvd;
    const int kh = h / (n_head / n_head_kv);
    float* qs = sh;
    float* sc = sh + hd;
    const float* qv = q + ((size_t)i * n_head + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qv[d];
    __syncthreads();
    __shared__ int qq[KVQ ? 64 : 1];
    __shared__ float qd[KVQ ? 8 : 1];
    if (KVQ) {
        quantize_query_q8(qs, hd, qq, qd);
        __syncthreads();
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    const bool vec = hd % 8 == 0 && kvd % 8 == 0 && ((size_t)kcache & 15) == 0;
    float mx = -INFINITY;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        float s = KVQ ? att_score_q8(qq, qd, kr.at(first + p, kh, hd), hd)
                      : att_score(qs, kcache + (size_t)p * kvd + kh * hd, hd, vec);
        s = __fmul_rn(s, scale);
        sc[p] = s;
        mx = fmaxf(mx, s);
    }
    __shared__ float red[32];
    mx = block_max(mx, red);
    if (sinks) mx = fmaxf(mx, sinks[h]);  // the sink joins the softmax as a position without a value
    float sum = 0.f;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        float e = expf(sc[p] - mx);
        sc[p] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < nw; w++) sum += red[w];
    if (sinks) sum += expf(sinks[h] - mx);
    const float inv = 1.0f / sum;
    for (int p = threadIdx.x; p < n; p += blockDim.x) sc[p] = KVQ ? sc[p] * inv : f16_round(sc[p] * inv);
    __syncthreads();
    float* o = out + ((size_t)i * n_head + h) * hd;
    // d0 + warp's first lane < hd is the same for the whole warp, so quantize_block_warp sees full warps
    for (int d0 = 0; d0 < hd; d0 += blockDim.x) {
        const int d = d0 + threadIdx.x;
        float acc = 0.f;
        if (d < hd) {
            if (KVQ) {
                for (int p = 0; p < n; p++) acc = __fadd_rn(acc, __fmul_rn(sc[p], vr.val(vr.at(first + p, kh, hd), d)));
            } else {
                const u16* vp = vcache + kh * hd + d;
#pragma unroll 4
                for (int p = 0; p < n; p++) acc = __fadd_rn(acc, __fmul_rn(sc[p], half_to_float(vp[(size_t)p * kvd])));
            }
            o[d] = acc;
        }
        if (outq && d - lane < hd) quantize_block_warp(acc, outq + ((size_t)i * n_head + h) * (hd / 32) + d / 32, lane);
    }
}

extern "C" __global__ void attention(const float* q, const u16* kcache, const u16* vcache, int n_head,
                                     int n_head_kv, int hd, const int* pos, float scale, float* out, Q8* outq,
                                     int window, const float* sinks) {
    attention_body<0>(q, kcache, vcache, n_head, n_head_kv, hd, pos, scale, out, outq, window, sinks);
}
extern "C" __global__ void attention_q8(const float* q, const u8* kcache, const u8* vcache, int n_head,
                                        int n_head_kv, int hd, const int* pos, float scale, float* out, Q8* outq,
                                        int window, const float* sinks) {
    attention_body<1>(q, kcache, vcache, n_head, n_head_kv, hd, pos, scale, out, outq, window, sinks);
}

// Split-K attention of a few query rows over a long KV cache (decode windows, `cap` > ATT_SPLIT_MIN positions) where
// the grouped tensor-core kernel (attention_decode_<hd>) does not run: head sizes it lacks, cards before sm_80,
// STRATA_GPU_ATT_DECODE=0.
// Block (h, i, z) takes positions [z * ATT_CHUNK, min((z + 1) * ATT_CHUNK, n)) of row i (n = pos0 + i + 1, the
// causal length) and writes its partial softmax — the chunk's max score m, l = Σ exp(s − m) and Σ exp(s − m) · V
// (hd values) — at part + ((i * n_head + h) * gridDim.z + z) * (hd + 2); a chunk past n writes l = 0.
// attention_combine merges a row's chunks. Scores are computed as in `attention` (same products and order); the
// probabilities are not rounded to f16 before the product with V (the merge rescales them), so the result
// differs from `attention` by rounding only. window > 0: positions before the row's last `window` do not count (a
// chunk wholly before them writes l = 0). Grid: (n_head, t, ceil(cap / ATT_CHUNK)); block: 128 threads; hd <= 256.
#define ATT_CHUNK 256
template <int KVQ>
__device__ void attention_split_body(const float* q, const void* kc, const void* vc, int n_head, int n_head_kv,
                                     int hd, const int* pos, float scale, float* part, int window) {
    pdl_entry();
    const u16* kcache = (const u16*)kc;
    const u16* vcache = (const u16*)vc;
    const KvRows<KVQ> kr(kc, n_head_kv * hd), vr(vc, n_head_kv * hd);
    __shared__ float qs[256];
    __shared__ float sc[ATT_CHUNK];
    __shared__ float red[32];
    const int pos0 = *pos;
    const int h = blockIdx.x, i = blockIdx.y, z = blockIdx.z;
    const int n = pos0 + i + 1;
    // the chunk's positions inside the row's window (all of them without one)
    const int p0 = max(z * ATT_CHUNK, window > 0 ? n - window : 0), p1 = min(z * ATT_CHUNK + ATT_CHUNK, n);
    float* pr = part + (((size_t)i * n_head + h) * gridDim.z + z) * (hd + 2);
    if (p0 >= p1) {
        if (threadIdx.x == 0) {
            pr[0] = -INFINITY;
            pr[1] = 0.f;
        }
        return;
    }
    const int kvd = n_head_kv * hd;
    const int kh = h / (n_head / n_head_kv);
    const float* qv = q + ((size_t)i * n_head + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qv[d];
    __syncthreads();
    __shared__ int qq[KVQ ? 64 : 1];
    __shared__ float qd[KVQ ? 8 : 1];
    if (KVQ) {
        quantize_query_q8(qs, hd, qq, qd);
        __syncthreads();
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    const bool vec = hd % 8 == 0 && kvd % 8 == 0 && ((size_t)kcache & 15) == 0;
    float mx = -INFINITY;
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
        const float s = __fmul_rn(KVQ ? att_score_q8(qq, qd, kr.at(p, kh, hd), hd)
                                      : att_score(qs, kcache + (size_t)p * kvd + kh * hd, hd, vec),
                                  scale);
        sc[p - p0] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, red);
    float sum = 0.f;
    for (int p = threadIdx.x; p < p1 - p0; p += blockDim.x) {
        const float e = expf(sc[p] - mx);
        sc[p] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float l = 0.f;
        for (int w = 0; w < nw; w++) l += red[w];
        pr[0] = mx;
        pr[1] = l;
    }
    const u16* vp = vcache + (size_t)p0 * kvd + kh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        if (KVQ) {
            for (int p = 0; p < p1 - p0; p++) acc = fmaf(sc[p], vr.val(vr.at(p0 + p, kh, hd), d), acc);
        } else {
#pragma unroll 4
            for (int p = 0; p < p1 - p0; p++) acc = fmaf(sc[p], half_to_float(vp[(size_t)p * kvd + d]), acc);
        }
        pr[2 + d] = acc;
    }
}

extern "C" __global__ void attention_split(const float* q, const u16* kcache, const u16* vcache, int n_head,
                                           int n_head_kv, int hd, const int* pos, float scale, float* part,
                                           int window) {
    attention_split_body<0>(q, kcache, vcache, n_head, n_head_kv, hd, pos, scale, part, window);
}
extern "C" __global__ void attention_split_q8(const float* q, const u8* kcache, const u8* vcache, int n_head,
                                              int n_head_kv, int hd, const int* pos, float scale, float* part,
                                              int window) {
    attention_split_body<1>(q, kcache, vcache, n_head, n_head_kv, hd, pos, scale, part, window);
}

// Merges the chunks of attention_split / attention_decode: out = Σ_z exp(m_z − M) · acc_z / Σ_z exp(m_z − M) · l_z
// (M the largest m_z of the chunks inside the row, and the sink's logit; sinks != null adds exp(sinks[h] − M) to
// the denominator), and its Q8 blocks when outq != null (hd % 32 == 0). Block (h, i, y) writes values
// [32·y, 32·y + 32) of head h in row i: it computes the chunks' weights (128 at a time, in shared memory), warp w
// sums chunks w, w + 4, … (a lane per value), and the four warps' sums are added in warp order (each value's sum
// is the same whatever the slicing). Grid: (n_head, t, ⌈hd / 32⌉); block: 128 threads.
extern "C" __global__ void __launch_bounds__(128) attention_combine(const float* part, int n_head, int hd, int nz,
                                                                    float* out, Q8* outq, const float* sinks) {
    pdl_entry();
    __shared__ float wz[128];
    __shared__ float red[32];
    __shared__ float ws[4][32];
    const int h = blockIdx.x, i = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int d = blockIdx.z * 32 + lane;  // this lane's value
    const float* pr = part + ((size_t)i * n_head + h) * nz * (hd + 2);
    // a chunk past the row's positions wrote (m, l) = (−inf, 0) and nothing else; any other chunk counts (a NaN in
    // it reaches the output, as in the one-block kernel)
#define ATT_LIVE(c) (!((c)[0] == -INFINITY && (c)[1] == 0.f))
    float M = -INFINITY;
    for (int z = threadIdx.x; z < nz; z += blockDim.x)
        if (ATT_LIVE(pr + (size_t)z * (hd + 2))) M = fmaxf(M, pr[(size_t)z * (hd + 2)]);
    M = block_max(M, red);
    if (sinks) M = fmaxf(M, sinks[h]);
    float L = 0.f;
    for (int z = threadIdx.x; z < nz; z += blockDim.x) {
        const float* c = pr + (size_t)z * (hd + 2);
        if (ATT_LIVE(c)) L += c[1] * expf(c[0] - M);
    }
    L = warp_sum(L);
    if (lane == 0) red[warp] = L;
    __syncthreads();
    L = 0.f;
    for (int w = 0; w < 4; w++) L += red[w];
    if (sinks) L += expf(sinks[h] - M);
    float acc = 0.f;
    for (int z0 = 0; z0 < nz; z0 += 128) {
        __syncthreads();
        if (z0 + threadIdx.x < nz) {
            const float* c = pr + (size_t)(z0 + threadIdx.x) * (hd + 2);
            wz[threadIdx.x] = ATT_LIVE(c) ? expf(c[0] - M) : -1.f;
        }
        __syncthreads();
        const int zn = min(128, nz - z0);
        if (d < hd) {
            const float* c = pr + (size_t)z0 * (hd + 2) + 2 + d;
#pragma unroll 4
            for (int z = warp; z < zn; z += 4) {
                const float w = wz[z];
                // w < 0: outside the row, its values never written (a live chunk's weight of 0 still multiplies
                // its values, so a NaN among them reaches the output)
                if (!(w < 0.f)) acc = fmaf(w, c[(size_t)z * (hd + 2)], acc);
            }
        }
    }
    ws[warp][lane] = acc;
    __syncthreads();
    if (warp == 0) {
        const float v = d < hd ? (((ws[0][lane] + ws[1][lane]) + ws[2][lane]) + ws[3][lane]) * (1.0f / L) : 0.f;
        if (d < hd) out[((size_t)i * n_head + h) * hd + d] = v;
        // (outq only with hd % 32 == 0: whole warps)
        if (outq) quantize_block_warp(v, outq + ((size_t)i * n_head + h) * (hd / 32) + d / 32, lane);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Tiled (flash-style) causal attention of a prefill chunk on tensor cores: no score matrix in memory, each K/V tile
// read once per block of FA_BQ query rows.
//
// Block (x, h): query rows [x * FA_BQ, x * FA_BQ + FA_BQ) of head h (FA_WARPS warps of 16 rows), walking the KV
// cache in tiles of FA_BK positions up to the block's last causal position; per tile, S = Q·Kᵀ on f16 MMA
// (m16n8k16, f32 accumulation; q rounded to f16 as it is packed, the cache f16; K and V fragments by ldmatrix, a
// step's fragments all loaded before its products), s = S · scale · log2 e, positions past a row's own masked
// (tiles that every row of a warp sees whole unmasked), online softmax in base 2 (running max m and sum l per row,
// in f32), then P·V with the probabilities 2^(s − m) rounded to f16 (f32 accumulation); out = acc / l at the end.
// The arithmetic differs from `attention` (which rounds the normalised probabilities to f16 and sums in position
// order) by rounding only. Head size HD (a multiple of 16, at most 128); K/V rows are read 16 bytes at a time (kvd %
// 8 == 0 and 16-byte aligned caches). Grid: (ceil(t / FA_BQ), n_head); block: 32 * FA_WARPS threads. The Q8 rows
// of out are a separate quantize launch.
// window > 0: a row attends to its last `window` positions (the walk starts at the tile of the block's first row's
// first one); sinks != null: each head's sink logit joins the softmax at the end.
#define FA_WARPS 4
#define FA_BQ (16 * FA_WARPS)
#define FA_BK 64
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    return (u32)float_to_half(lo) | ((u32)float_to_half(hi) << 16);
}

// D = A·B + D for one m16n8k16 tile (A row-major f16 16×16, B column-major f16 16×8, D f32 16×8; sm_80+, as
// mma_s8_16832_biased).
__device__ __forceinline__ void mma_16816(float* d, const u32* a, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// 8 values of a Q8_0 row from value `off` (a multiple of 8) as f16 (d · q rounded to f16, as llama.cpp's tensor-core
// attention converts a quantized cache).
__device__ __forceinline__ uint4 q8_row_half8(const u8* row, int off) {
    const u8* b = row + (off / 32) * 34;
    const float d = h2f(b);
    const u16* w = (const u16*)(b + 2 + off % 32);
    u32 o[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const u16 v = w[j];
        o[j] = pack_half2(d * (float)(signed char)(v & 0xff), d * (float)(signed char)(v >> 8));
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// The m16n8k16 A fragments (f16) of query rows r0 (fragment rows g) and r1 (rows g + 8), HD f32 values each, for
// lane quad position tg; a row that is not `live` reads as zeros.
template <int HD>
__device__ __forceinline__ void fa_q_frags(u32 (*qa)[4], const float* r0, const float* r1, bool live0, bool live1,
                                           int tg) {
#pragma unroll
    for (int kt = 0; kt < HD / 16; kt++) {
        const int c = kt * 16 + 2 * tg;
        const float2 a0 = live0 ? *(const float2*)(r0 + c) : make_float2(0.f, 0.f);
        const float2 a1 = live1 ? *(const float2*)(r1 + c) : make_float2(0.f, 0.f);
        const float2 a2 = live0 ? *(const float2*)(r0 + c + 8) : make_float2(0.f, 0.f);
        const float2 a3 = live1 ? *(const float2*)(r1 + c + 8) : make_float2(0.f, 0.f);
        qa[kt][0] = pack_half2(a0.x, a0.y);
        qa[kt][1] = pack_half2(a1.x, a1.y);
        qa[kt][2] = pack_half2(a2.x, a2.y);
        qa[kt][3] = pack_half2(a3.x, a3.y);
    }
}

// The maxima of rows g (mx0) and g + 8 (mx1) over the four lanes of a quad that hold them.
__device__ __forceinline__ void fa_quad_max(float& mx0, float& mx1) {
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
}

// The running output of rows g and g + 8 (HD / 8 fragments of m16n8) rescaled by a0 and a1.
template <int HD>
__device__ __forceinline__ void fa_rescale(float (*acc)[4], float a0, float a1) {
#pragma unroll
    for (int j = 0; j < HD / 8; j++) {
        acc[j][0] *= a0;
        acc[j][1] *= a0;
        acc[j][2] *= a1;
        acc[j][3] *= a1;
    }
}

// Four 8×8 matrices of 16-bit values from shared memory (ldmatrix, sm_75+): lane l gives the address of row l % 8 of
// matrix l / 8 (16 bytes, 16-byte aligned); r[m] gets matrix m's row lane / 4, values 2·(lane % 4) and the next
// (TRANS: its rows 2·(lane % 4) and the next of column lane / 4), the layout of an m16n8k16 B fragment register.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(u32* r, const u16* p) {
#if __CUDA_ARCH__ >= 750
    const u32 a = smem_u32(p);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
#else
    __trap();
#endif
}

// acc += P·V over 16 positions: pa the A fragments of P (16 rows × 16 positions), v0 the f16 V tile (rows LD halves
// apart) at the first of the 16 positions; the B fragments of two 8-column slices per ldmatrix (transposed: matrices
// positions 0-7 and 8-15 of slice j, then of slice j + 1).
template <int HD, int LD>
__device__ __forceinline__ void fa_pv(float (*acc)[4], const u32* pa, const u16* v0, int lane) {
    const int m = lane >> 3;
    const u16* vl = v0 + ((m & 1) * 8 + (lane & 7)) * LD + (m >> 1) * 8;
    u32 b[HD / 16][4];
#pragma unroll
    for (int jj = 0; jj < HD / 16; jj++) ldsm_x4<true>(b[jj], vl + jj * 16);
#pragma unroll
    for (int jj = 0; jj < HD / 16; jj++) {
        mma_16816(acc[2 * jj], pa, b[jj][0], b[jj][1]);
        mma_16816(acc[2 * jj + 1], pa, b[jj][2], b[jj][3]);
    }
}

template <int HD, int KVQ>
__device__ void attention_tiled_body(const float* q, const void* kc, const void* vc, int n_head, int n_head_kv,
                                     int t, const int* pos, float scale, float* out, int window, const float* sinks) {
    const u16* kcache = (const u16*)kc;
    const u16* vcache = (const u16*)vc;
    constexpr int LD = HD + 8;  // shared row stride in halves: rows 4 banks apart, no conflicts in the B loads
    __shared__ __align__(16) u16 ks[FA_BK * LD];
    __shared__ __align__(16) u16 vs[FA_BK * LD];
    // q (RoPE's output) and pos0 are read after the wait on the previous kernel
    pdl_trigger();
    pdl_wait();
    const int pos0 = *pos;
    const int h = blockIdx.y, kh = h / (n_head / n_head_kv);
    const int kvd = n_head_kv * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
    const int qb = blockIdx.x * FA_BQ;
    const int i0 = qb + warp * 16 + g, i1 = i0 + 8;  // this thread's two rows
    const int n_blk = pos0 + min(t, qb + FA_BQ);       // causal length of the block's last row
    // Q fragments (rows past t read as zeros; their results are not written)
    u32 qa[HD / 16][4];
    fa_q_frags<HD>(qa, q + ((size_t)i0 * n_head + h) * HD, q + ((size_t)i1 * n_head + h) * HD, i0 < t, i1 < t, tg);
    const int qp0 = pos0 + i0, qp1 = pos0 + i1;  // the rows' positions: keys at or before them count
    // and with a sliding window, keys after qp − window only; the block's first row's window starts the walk
    const int lo0 = window > 0 ? qp0 - window + 1 : 0, lo1 = window > 0 ? qp1 - window + 1 : 0;
    const int p_first = window > 0 ? max(0, pos0 + qb - window + 1) / FA_BK * FA_BK : 0;
    float acc[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    // the scores in base-2 units (s · scale · log2 e), so that each exponential is one exp2
    const float sl2 = scale * LOG2E;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    for (int p0 = p_first; p0 < n_blk; p0 += FA_BK) {
        __syncthreads();  // the previous tile's readers are done
        constexpr int CH = HD / 8;  // 16-byte chunks per row
        for (int c = threadIdx.x; c < FA_BK * CH; c += 32 * FA_WARPS) {
            const int r = c / CH, off = (c % CH) * 8;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (p0 + r < n_blk) {
                if (KVQ) {
                    const KvRows<1> kr(kc, kvd), vr(vc, kvd);
                    kv = q8_row_half8(kr.at(p0 + r, kh, HD), off);
                    vv = q8_row_half8(vr.at(p0 + r, kh, HD), off);
                } else {
                    const size_t src = (size_t)(p0 + r) * kvd + (size_t)kh * HD + off;
                    kv = *(const uint4*)(kcache + src);
                    vv = *(const uint4*)(vcache + src);
                }
            }
            *(uint4*)(ks + r * LD + off) = kv;
            *(uint4*)(vs + r * LD + off) = vv;
        }
        __syncthreads();
        if (p0 > pos0 + min(qb + warp * 16 + 15, t - 1)) continue;  // the warp's rows all end before this tile
        float s[FA_BK / 8][4];
#pragma unroll
        for (int j = 0; j < FA_BK / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        {
            // the B fragments of two 8-position slices per ldmatrix: matrices (slice j, values 0-7), (j, 8-15),
            // (j + 1, 0-7), (j + 1, 8-15)
            const int m = lane >> 3;
            const u16* kl = ks + ((m >> 1) * 8 + (lane & 7)) * LD + (m & 1) * 8;
#pragma unroll
            for (int kt = 0; kt < HD / 16; kt++) {
                // the step's fragments first, then its products (the loads' latency paid once per step)
                u32 b[FA_BK / 16][4];
#pragma unroll
                for (int jj = 0; jj < FA_BK / 16; jj++) ldsm_x4<false>(b[jj], kl + jj * 16 * LD + kt * 16);
#pragma unroll
                for (int jj = 0; jj < FA_BK / 16; jj++) {
                    mma_16816(s[2 * jj], qa[kt], b[jj][0], b[jj][1]);
                    mma_16816(s[2 * jj + 1], qa[kt], b[jj][2], b[jj][3]);
                }
            }
        }
        float mx0 = -INFINITY, mx1 = -INFINITY;
        // a tile every row of the warp sees whole (its last position at or before the warp's first row, and inside
        // the last row's window) needs no mask
        const int wr0 = pos0 + qb + warp * 16;
        if (p0 + FA_BK - 1 <= wr0 && (window <= 0 || p0 >= wr0 + 15 - window + 1)) {
#pragma unroll
            for (int j = 0; j < FA_BK / 8; j++) {
                s[j][0] *= sl2;
                s[j][1] *= sl2;
                s[j][2] *= sl2;
                s[j][3] *= sl2;
                mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
                mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
            }
        } else {
#pragma unroll
            for (int j = 0; j < FA_BK / 8; j++) {
                const int p = p0 + j * 8 + 2 * tg;
                s[j][0] = p <= qp0 && p >= lo0 ? s[j][0] * sl2 : -INFINITY;
                s[j][1] = p + 1 <= qp0 && p + 1 >= lo0 ? s[j][1] * sl2 : -INFINITY;
                s[j][2] = p <= qp1 && p >= lo1 ? s[j][2] * sl2 : -INFINITY;
                s[j][3] = p + 1 <= qp1 && p + 1 >= lo1 ? s[j][3] * sl2 : -INFINITY;
                mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
                mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
            }
        }
        fa_quad_max(mx0, mx1);
        // without a window every row has position 0 in the first tile, so its running max is finite from then on;
        // with one a row may have no position in a tile yet (max −inf: nothing to rescale, nothing to add)
        const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
        const float a0 = nm0 == -INFINITY ? 1.f : exp2f(m0 - nm0), a1 = nm1 == -INFINITY ? 1.f : exp2f(m1 - nm1);
        m0 = nm0;
        m1 = nm1;
        const float e0 = m0 == -INFINITY ? 0.f : m0, e1 = m1 == -INFINITY ? 0.f : m1;
        l0 *= a0;
        l1 *= a1;
        // deep in a context most tiles raise no row's maximum: factors of exactly 1 leave acc as it is, so the
        // warp skips the HD / 2 multiplications per thread (the same bits)
        if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) fa_rescale<HD>(acc, a0, a1);
#pragma unroll
        for (int j = 0; j < FA_BK / 8; j++) {
            s[j][0] = exp2f(s[j][0] - e0);
            s[j][1] = exp2f(s[j][1] - e0);
            s[j][2] = exp2f(s[j][2] - e1);
            s[j][3] = exp2f(s[j][3] - e1);
            l0 += s[j][0] + s[j][1];
            l1 += s[j][2] + s[j][3];
        }
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; kk++) {
            const u32 pa[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                               pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            fa_pv<HD, LD>(acc, pa, vs + kk * 16 * LD, lane);
        }
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    }
    float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    if (sinks) {
        // the sink joins each row's softmax: with M = max(m, sink), out = acc·2^(m−M) / (l·2^(m−M) + 2^(sink−M))
        // (m, M and the sink in base-2 units)
        const float sk = sinks[h] * LOG2E;
        const float M0 = fmaxf(m0, sk), M1 = fmaxf(m1, sk);
        const float f0 = exp2f(m0 - M0), f1 = exp2f(m1 - M1);
        inv0 = f0 / (l0 * f0 + exp2f(sk - M0));
        inv1 = f1 / (l1 * f1 + exp2f(sk - M1));
    }
#pragma unroll
    for (int j = 0; j < HD / 8; j++) {
        const int d = j * 8 + 2 * tg;
        if (i0 < t) *(float2*)(out + ((size_t)i0 * n_head + h) * HD + d) = make_float2(acc[j][0] * inv0, acc[j][1] * inv0);
        if (i1 < t) *(float2*)(out + ((size_t)i1 * n_head + h) * HD + d) = make_float2(acc[j][2] * inv1, acc[j][3] * inv1);
    }
}

#define ATTENTION_TILED(HD)                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS) attention_tiled_##HD(                             \
        const float* q, const u16* kcache, const u16* vcache, int n_head, int n_head_kv, int t, const int* pos,   \
        float scale, float* out, int window, const float* sinks) {                                                \
        attention_tiled_body<HD, 0>(q, kcache, vcache, n_head, n_head_kv, t, pos, scale, out, window, sinks);    \
    }
// over a Q8_0 cache: head sizes that are multiples of 32 (whole Q8_0 blocks per head)
#define ATTENTION_TILED_Q8(HD)                                                                                    \
    static_assert(HD % 32 == 0, "Q8_0 rows hold whole 32-value blocks per head");                              \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS) attention_tiled_q8_##HD(                          \
        const float* q, const u8* kcache, const u8* vcache, int n_head, int n_head_kv, int t, const int* pos,     \
        float scale, float* out, int window, const float* sinks) {                                                \
        attention_tiled_body<HD, 1>(q, kcache, vcache, n_head, n_head_kv, t, pos, scale, out, window, sinks);    \
    }
ATTENTION_TILED(64)
ATTENTION_TILED(80)
ATTENTION_TILED(96)
ATTENTION_TILED(128)
ATTENTION_TILED_Q8(64)
ATTENTION_TILED_Q8(96)
ATTENTION_TILED_Q8(128)

// ---------------------------------------------------------------------------------------------------------------
// Decode attention over a long KV cache on tensor cores, split over the positions and grouped by KV head
// (flash-decoding): the query heads that share a KV head are the rows of one m16n8k16 product, so every K/V row is
// read from memory once for all of them.
//
// Block (c, i, z): KV head kh = c / ngrp; its query heads [kh·G + (c % ngrp)·gb, +gb) (G = n_head / n_head_kv
// share the KV head; gb = ⌈G / ngrp⌉ ≤ ATT_DG = 16 per block, fewer in the last group) as the 16 rows of the
// products (rows past gb are zeros); query row i; positions [z·chunk, min((z + 1)·chunk, n)) with n = pos0 + i + 1
// (from n − window on when window > 0). Tiles of ATT_DTILE positions of K and V (f16 rows, HD + 8 halves apart)
// are copied into shared memory, two tiles in flight (cp.async; a Q8_0 cache: loaded and converted to f16 as
// attention_tiled_q8 does, one tile at a time); each of the ATT_DWARPS warps takes 16 positions of a tile: S = Q·Kᵀ
// (f16 MMA, f32 accumulation; the query rounded to f16 as it is packed), s = S · scale, its own running softmax
// per row (max m, sum l), then P·V with P = exp(s − m) rounded to f16. At the end the warps' partials are merged
// and written in attention_combine's layout: (m, l, HD values) at part + ((i·n_head + h)·gridDim.z + z)·(HD + 2)
// for each head h; a chunk outside the row writes (−inf, 0). The arithmetic differs from `attention`'s by rounding
// only (as attention_tiled's does). Grid: (n_head_kv · ngrp, t, nz); block: 32 · ATT_DWARPS threads; dynamic
// shared memory: att_decode_smem (ops.rs). HD: 64, 80, 96, 128 (Q8_0: 64, 96, 128).
#define ATT_DG 16
#define ATT_DWARPS 4
#define ATT_DTILE (16 * ATT_DWARPS)

// Copies `cnt` rows of `rbytes` bytes (source stride `rb`, destination stride `ds`) in pieces of 16 bytes by
// cp.async (`unit` 16; the caller commits and waits) or of 2 bytes by plain loads (`unit` 2: rows not 16-byte
// aligned, or before sm_80).
__device__ __forceinline__ void att_dec_copy(u8* dst, int ds, const u8* src, size_t rb, int rbytes, int cnt,
                                             int unit) {
    const int per = rbytes / unit;
    for (int x = threadIdx.x; x < cnt * per; x += blockDim.x) {
        const int r = x / per, c = x - r * per;
        u8* d = dst + r * ds + c * unit;
        const u8* s = src + (size_t)r * rb + c * unit;
#if __CUDA_ARCH__ >= 800
        if (unit == 16)
            cp_async<16>(d, s);
        else
#endif
            *(u16*)d = *(const u16*)s;
    }
}

template <int HD, int KVQ>
__device__ void attention_decode_body(const float* q, const u8* kc, const u8* vc, int n_head, int n_head_kv,
                                      const int* pos, float scale, float* part, int window, int chunk, int ngrp,
                                      int pre) {
    constexpr int LD = HD + 8;                     // shared row stride in halves (as attention_tiled)
    constexpr int SB = 2 * ATT_DTILE * LD * 2;     // bytes of a stage: K and V tiles
    constexpr int NST = KVQ ? 1 : 2;               // stages
    pdl_trigger();
    extern __shared__ __align__(16) u8 dsm[];
    const int G = n_head / n_head_kv;
    const int kh = blockIdx.x / ngrp, gb = (G + ngrp - 1) / ngrp;
    const int h0 = kh * G + (blockIdx.x % ngrp) * gb;
    const int gcnt = min(gb, kh * G + G - h0);
    const int i = blockIdx.y, z = blockIdx.z;
    // Before the wait this kernel reads only what no kernel of this pass writes: pos0 (the pass's input) and K/V rows
    // of earlier passes. Both hold because every pass starts with host-to-device copies of its inputs (Stage::chunk:
    // embeddings and the RoPE table with pos0), which wait for every earlier kernel on the stream, and only the
    // RoPE kernels write the cache (rows pos0 .. of this pass). A pass without input copies would need the wait
    // first.
    const int pos0 = *pos, n = pos0 + i + 1;
    const int p0 = max(z * chunk, window > 0 ? n - window : 0), p1 = min(z * chunk + chunk, n);
    if (gcnt <= 0) return;
    // a tile whose positions all precede pos0 holds K/V rows of earlier passes (this pass's rope_store writes rows
    // pos0 ..): with `pre`, its copy starts before the wait, overlapping the kernels before this one
    auto old = [&](int t) { return pre && p0 < p1 && min(p0 + (t + 1) * ATT_DTILE, p1) <= pos0; };
    if (p0 >= p1) {
        pdl_wait();  // `part` may still be read by an earlier kernel
        if (threadIdx.x < gcnt) {
            float* pr = part + (((size_t)i * n_head + h0 + threadIdx.x) * gridDim.z + z) * (HD + 2);
            pr[0] = -INFINITY;
            pr[1] = 0.f;
        }
        return;
    }
    const int kvd = n_head_kv * HD;
    const int rbytes = KVQ ? HD / 32 * 34 : HD * 2;
    const size_t rb = KVQ ? (size_t)(kvd / 32) * 34 : (size_t)kvd * 2;
    const u8* kb = kc + (size_t)kh * rbytes;
    const u8* vb = vc + (size_t)kh * rbytes;
#if __CUDA_ARCH__ >= 800
    const int unit = (((unsigned long long)kb | (unsigned long long)vb | rb) & 15) == 0 ? 16 : 2;
#else
    const int unit = 2;
#endif
    const int ntile = (p1 - p0 + ATT_DTILE - 1) / ATT_DTILE;
    // tile t into stage t % NST: its rows, zeros past the chunk's end (their V rows are multiplied by P = 0)
    auto issue = [&](int t) {
        const int pb = p0 + t * ATT_DTILE, cnt = min(ATT_DTILE, p1 - pb);
        u16* ks = (u16*)(dsm + (t % NST) * SB);
        u16* vs = ks + ATT_DTILE * LD;
        if (KVQ) {
            constexpr int CH = HD / 8;
            for (int c = threadIdx.x; c < ATT_DTILE * CH; c += blockDim.x) {
                const int r = c / CH, off = (c % CH) * 8;
                uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
                if (r < cnt) {
                    kv = q8_row_half8(kb + (size_t)(pb + r) * rb, off);
                    vv = q8_row_half8(vb + (size_t)(pb + r) * rb, off);
                }
                *(uint4*)(ks + r * LD + off) = kv;
                *(uint4*)(vs + r * LD + off) = vv;
            }
        } else {
            att_dec_copy((u8*)ks, LD * 2, kb + (size_t)pb * rb, rb, rbytes, cnt, unit);
            att_dec_copy((u8*)vs, LD * 2, vb + (size_t)pb * rb, rb, rbytes, cnt, unit);
            for (int c = threadIdx.x; c < (ATT_DTILE - cnt) * (HD / 8); c += blockDim.x) {
                const int r = cnt + c / (HD / 8), off = (c % (HD / 8)) * 8;
                *(uint4*)(ks + r * LD + off) = make_uint4(0, 0, 0, 0);
                *(uint4*)(vs + r * LD + off) = make_uint4(0, 0, 0, 0);
            }
        }
    };
    // (the copies issued before the wait join the first group committed after it: its waits only get stricter)
    if (old(0)) issue(0);
    if (NST > 1 && ntile > 1 && old(1)) issue(1);
    pdl_wait();
    if (!old(0)) issue(0);
    cp_async_commit();
    if (NST > 1 && ntile > 1 && !old(1)) issue(1);
    cp_async_commit();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
    // Q fragments: rows g and g + 8 are heads h0 + g and h0 + g + 8 (zeros past gcnt)
    u32 qa[HD / 16][4];
    {
        const float* r0 = q + ((size_t)i * n_head + h0 + g) * HD;
        fa_q_frags<HD>(qa, r0, r0 + 8 * HD, g < gcnt, g + 8 < gcnt, tg);
    }
    float acc[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    for (int t = 0; t < ntile; t++) {
        if (NST > 1) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* ks = (const u16*)(dsm + (t % NST) * SB);
        const u16* vs = ks + ATT_DTILE * LD;
        const int w0 = warp * 16;                    // the warp's first position in the tile
        const int live = p1 - (p0 + t * ATT_DTILE);  // positions of the tile inside the chunk (from 1)
        if (w0 < live) {
            float s[2][4];
#pragma unroll
            for (int j = 0; j < 2; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int kt = 0; kt < HD / 16; kt++) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const u16* kr = ks + (w0 + j * 8 + g) * LD + kt * 16 + 2 * tg;
                    mma_16816(s[j], qa[kt], *(const u32*)kr, *(const u32*)(kr + 8));
                }
            }
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int r = w0 + j * 8 + 2 * tg;
                s[j][0] = r < live ? s[j][0] * scale : -INFINITY;
                s[j][1] = r + 1 < live ? s[j][1] * scale : -INFINITY;
                s[j][2] = r < live ? s[j][2] * scale : -INFINITY;
                s[j][3] = r + 1 < live ? s[j][3] * scale : -INFINITY;
                mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
                mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
            }
            fa_quad_max(mx0, mx1);
            // the warp's first position is live, so the new maxima are finite
            const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
            const float a0 = expf(m0 - nm0), a1 = expf(m1 - nm1);
            m0 = nm0;
            m1 = nm1;
            l0 *= a0;
            l1 *= a1;
            fa_rescale<HD>(acc, a0, a1);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                s[j][0] = expf(s[j][0] - m0);
                s[j][1] = expf(s[j][1] - m0);
                s[j][2] = expf(s[j][2] - m1);
                s[j][3] = expf(s[j][3] - m1);
                l0 += s[j][0] + s[j][1];
                l1 += s[j][2] + s[j][3];
            }
            const u32 pa[4] = {pack_half2(s[0][0], s[0][1]), pack_half2(s[0][2], s[0][3]),
                               pack_half2(s[1][0], s[1][1]), pack_half2(s[1][2], s[1][3])};
            fa_pv<HD, LD>(acc, pa, vs + w0 * LD, lane);
        }
        __syncthreads();
        if (t + NST < ntile) issue(t + NST);
        cp_async_commit();
    }
    cp_async_wait<0>();
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    }
    __syncthreads();
    // the warps' partials (a warp without positions has m = −inf, l = 0 and is skipped; one whose scores were all
    // NaN has m = −inf and l = NaN, which reaches the output as in the one-block kernel; so does one whose live
    // scores were all −inf, an infinite K value, where the one-block kernel gives those positions weight 0 when
    // other positions are finite), merged per row
    float* wm = (float*)dsm;
    float* wl = wm + ATT_DWARPS * ATT_DG;
    float* wa = wl + ATT_DWARPS * ATT_DG;
    if (tg == 0) {
        wm[warp * ATT_DG + g] = m0;
        wm[warp * ATT_DG + g + 8] = m1;
        wl[warp * ATT_DG + g] = l0;
        wl[warp * ATT_DG + g + 8] = l1;
    }
#pragma unroll
    for (int j = 0; j < HD / 8; j++) {
        const int d = j * 8 + 2 * tg;
        *(float2*)(wa + (warp * ATT_DG + g) * HD + d) = make_float2(acc[j][0], acc[j][1]);
        *(float2*)(wa + (warp * ATT_DG + g + 8) * HD + d) = make_float2(acc[j][2], acc[j][3]);
    }
    __syncthreads();
    for (int x = threadIdx.x; x < gcnt * (HD + 2); x += blockDim.x) {
        const int r = x / (HD + 2), c = x - r * (HD + 2);
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < ATT_DWARPS; w++) M = fmaxf(M, wm[w * ATT_DG + r]);
        float v = M;
        if (c > 0) {
            v = 0.f;
#pragma unroll
            for (int w = 0; w < ATT_DWARPS; w++) {
                const float mw = wm[w * ATT_DG + r];
                if (!(mw == -INFINITY && wl[w * ATT_DG + r] == 0.f))
                    v = fmaf(expf(mw - M), c == 1 ? wl[w * ATT_DG + r] : wa[(w * ATT_DG + r) * HD + c - 2], v);
            }
        }
        part[(((size_t)i * n_head + h0 + r) * gridDim.z + z) * (HD + 2) + c] = v;
    }
}

#define ATT_DECODE_KERNEL(NAME, HD, KVQ)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * ATT_DWARPS)                                                 \
        NAME(const float* q, const u8* kcache, const u8* vcache, int n_head, int n_head_kv, const int* pos,      \
             float scale, float* part, int window, int chunk, int ngrp, int pre) {                                \
        attention_decode_body<HD, KVQ>(q, kcache, vcache, n_head, n_head_kv, pos, scale, part, window, chunk,      \
                                       ngrp, pre);                                                                \
    }
ATT_DECODE_KERNEL(attention_decode_64, 64, 0)
ATT_DECODE_KERNEL(attention_decode_80, 80, 0)
ATT_DECODE_KERNEL(attention_decode_96, 96, 0)
ATT_DECODE_KERNEL(attention_decode_128, 128, 0)
static_assert(64 % 32 == 0 && 96 % 32 == 0 && 128 % 32 == 0, "Q8_0 rows hold whole 32-value blocks per head");
ATT_DECODE_KERNEL(attention_decode_q8_64, 64, 1)
ATT_DECODE_KERNEL(attention_decode_q8_96, 96, 1)
ATT_DECODE_KERNEL(attention_decode_q8_128, 128, 1)

// ---------------------------------------------------------------------------------------------------------------
// Experts from VRAM slots.
//
// A group = one expert (its slot) and up to MAX_NT tokens routed to it; `pair[j]` is the routing entry
// (token * k + rank) whose result row the group writes. All hit experts of a layer run in one launch per stage.
struct Group {
    int slot;
    int nt;
    int tok[MAX_NT];
    int pair[MAX_NT];
};

// Float → u32 key with the same order (for integer warp reductions).
__device__ __forceinline__ u32 ord_key(float v) {
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffffu, v);
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}

__device__ __forceinline__ u32 warp_min_u32(u32 v) { return ~warp_max_u32(~v); }

// Router: softmax over n_expert logits (plus `bias`, per expert, when not null), top-k (ties: lower expert first),
// weights renormalised to sum 1 when `norm` is 1 (their sum clamped at 2^-14), the softmax probabilities themselves
// when 0, the softmax of the k chosen logits alone when 2 (gpt-oss; the same top-k, softmax being monotonic).
// One warp per token (grid t, 32 threads); n_expert <= 1024, k <= 32. ids/w: t * k.
// Each lane keeps the best expert it has not given away; a round is one integer max and one min over the warp.
// table != null (decode windows with every expert looked up on the device): also one group per routing entry,
// slot from the layer's residency table (-1 = not in VRAM: the group is empty and the CPU computes it), and
// flag[p] = 1 when the group is computed here. win != null: the ids are also stored there (the window's record).
// The top-k of one token's logits `ls` (n_expert values in shared memory, written and synced by the caller) by
// one warp (see route_topk below); token i's entries are p = i * k + r.
__device__ __forceinline__ void topk_warp(const float* ls, int n_expert, int k, int i, int* ids, float* w,
                                          const int* table, Group* groups, int* flag, int* win, int norm) {
    const int lane = threadIdx.x % 32;
    float mx = -INFINITY;
    for (int e = lane; e < n_expert; e += 32) mx = fmaxf(mx, ls[e]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < n_expert; e += 32) sum += expf(ls[e] - mx);
    sum = warp_sum(sum);
    u32 taken = 0;  // bit j: this lane's expert lane + 32 * j was taken (n_expert <= 1024)
    u32 bkey = 0;
    int bidx = 0x7fffffff;
    bool rescan = true;
    float wsum = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int r = 0; r < k; r++) {
        if (rescan) {
            bkey = 0;
            bidx = 0x7fffffff;
            for (int j = 0, e = lane; e < n_expert; j++, e += 32) {
                if (taken & (1u << j)) continue;
                const u32 kv = ord_key(ls[e]);
                if (kv > bkey) {  // ascending e: the first of equal keys stays
                    bkey = kv;
                    bidx = e;
                }
            }
            rescan = false;
        }
        const u32 top = warp_max_u32(bkey);
        const int be = (int)warp_min_u32(bkey == top ? (u32)bidx : 0xffffffffu);
        if (be % 32 == lane) {
            taken |= 1u << (be / 32);
            rescan = true;
        }
        // norm 2 (the softmax of the chosen logits): exp(l − max) here, divided by their sum below
        const float p = norm == 2 ? expf(ls[be] - mx) : expf(ls[be] - mx) / sum;
        if (lane == r) {
            my_id = be;
            my_p = p;
        }
        wsum += p;
    }
    if (lane < k) {
        const int p = i * k + lane;
        ids[p] = my_id;
        w[p] = norm == 2 ? my_p / wsum : norm ? my_p / fmaxf(wsum, 6.103515625e-5f) : my_p;
        if (win) win[p] = my_id;
        if (table) {
            const int slot = table[my_id];
            Group* g = groups + p;
            g->slot = slot;
            g->nt = slot >= 0 ? 1 : 0;
            g->tok[0] = i;
            g->pair[0] = p;
            flag[p] = slot >= 0 ? 1 : 0;
        }
    }
}

#define TOPK_MAX_EXPERTS 1024
extern "C" __global__ void route_topk(const float* logits, int n_expert, int k, int* ids, float* w, const int* table,
                                      Group* groups, int* flag, int* win, int norm, const float* bias) {
    pdl_entry();
    __shared__ float ls[TOPK_MAX_EXPERTS];
    const int i = blockIdx.x;
    for (int e = threadIdx.x; e < n_expert; e += 32) {
        const float v = logits[(size_t)i * n_expert + e];
        ls[e] = bias ? v + bias[e] : v;
    }
    __syncwarp();
    topk_warp(ls, n_expert, k, i, ids, w, table, groups, flag, win, norm);
}

// One token's router product over f32 weights (n_expert rows; mmv_f32_t1's blocks, sums and logits) and
// route_topk in one launch, with their bits: every block writes its RPW logits, and the block that finishes last
// (last_block) runs route_topk's warp over all of them, read back from L2. Arguments after `done` as route_topk's (token 0). Grid: ceil(n_expert / RPW); block: 32 * WARPS;
// n_expert <= TOPK_MAX_EXPERTS, k <= 32, *done 0 before the first launch.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
    route_f32_t1(const u8* __restrict__ w, int n_expert, int cols, const float* xf, float* logits, unsigned* done,
                 int k, int* ids, float* wout, const int* table, Group* groups, int* flag, int* win, int norm,
                 const float* bias) {
    pdl_trigger();
    mmv_float_body<FMT_F32, 1, true>(w, nullptr, nullptr, n_expert, 0, 0, cols, xf, cols, logits, n_expert, 0);
    __shared__ float ls[TOPK_MAX_EXPERTS];
    if (!last_block(done) || threadIdx.x >= 32) return;
    for (int e = threadIdx.x; e < n_expert; e += 32) {
        const float v = __ldcg(logits + e);
        ls[e] = bias ? v + bias[e] : v;
    }
    __syncwarp();
    topk_warp(ls, n_expert, k, 0, ids, wout, table, groups, flag, win, norm);
}

// Groups of up to MAX_NT tokens per expert from a prefill chunk's routing (every expert in VRAM): the n_pairs =
// t * k entries `ids` are counted per expert, each entry takes the next place of its expert (shared-memory atomics:
// the order of tokens inside an expert's groups varies between runs, which changes no result, since each token's
// sums are computed alike wherever it sits in a group), and the experts' groups are laid out in expert order.
// groups[0 .. max_groups) are written: the used ones, then empty ones (nt = 0) up to max_groups, which must be at
// least Σ_e ceil(count_e / MAX_NT) (≤ min(n_pairs, ceil(n_pairs / MAX_NT) + n_expert)). flag[p] = 1 for every
// entry whose expert has a slot (table[e] >= 0; -1: no group, flag 0). `rank` is scratch of n_pairs ints.
// tiles != null: also each expert's groups in tiles of up to MQ_GPT consecutive groups ({first group, groups}),
// max_tiles of them (≥ Σ_e ceil(count_e / MQ_BN)), the empty ones ({0, 0}) last.
// One block of GROUP_THREADS threads; n_expert <= TOPK_MAX_EXPERTS.
#define GROUP_THREADS 1024
extern "C" __global__ void group_by_expert(const int* ids, int n_pairs, int k, int n_expert, const int* table,
                                           Group* groups, int max_groups, int* flag, int* rank, int2* tiles,
                                           int max_tiles) {
    pdl_entry();
    __shared__ int cnt[TOPK_MAX_EXPERTS];
    __shared__ int off[TOPK_MAX_EXPERTS];
    __shared__ int toff[TOPK_MAX_EXPERTS];
    __shared__ int total, total_tiles;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) rank[p] = atomicAdd(&cnt[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x < 32) {
        // groups per expert, prefix sum in expert order (one warp, 32 experts per step)
        int carry = 0, tcarry = 0;
        for (int e0 = 0; e0 < n_expert; e0 += 32) {
            const int e = e0 + threadIdx.x;
            const int n = e < n_expert && table[e] >= 0 ? (cnt[e] + MAX_NT - 1) / MAX_NT : 0;
            const int nt = (n + MQ_GPT - 1) / MQ_GPT;
            int inc = n, tinc = nt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, inc, o);
                const int tv = __shfl_up_sync(0xffffffffu, tinc, o);
                if ((int)threadIdx.x >= o) {
                    inc += v;
                    tinc += tv;
                }
            }
            if (e < n_expert) {
                off[e] = carry + inc - n;
                toff[e] = tcarry + tinc - nt;
            }
            carry += __shfl_sync(0xffffffffu, inc, 31);
            tcarry += __shfl_sync(0xffffffffu, tinc, 31);
        }
        if (threadIdx.x == 0) {
            total = carry;
            total_tiles = tcarry;
        }
    }
    __syncthreads();
    if (tiles) {
        // an expert's groups in tiles of up to MQ_GPT (the tensor-core expert kernels' MQ_BN columns)
        for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
            const int n = table[e] >= 0 ? (cnt[e] + MAX_NT - 1) / MAX_NT : 0;
            for (int i = 0; i * MQ_GPT < n; i++) tiles[toff[e] + i] = make_int2(off[e] + i * MQ_GPT, min(MQ_GPT, n - i * MQ_GPT));
        }
        for (int i = total_tiles + threadIdx.x; i < max_tiles; i += blockDim.x) tiles[i] = make_int2(0, 0);
    }
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int e = ids[p], slot = table[e];
        flag[p] = slot >= 0 ? 1 : 0;
        if (slot < 0) continue;
        const int r = rank[p];
        Group* g = groups + off[e] + r / MAX_NT;
        g->tok[r % MAX_NT] = p / k;
        g->pair[r % MAX_NT] = p;
        if (r % MAX_NT == 0) {
            g->slot = slot;
            g->nt = min(MAX_NT, cnt[e] - r);
        }
    }
    for (int i = total + threadIdx.x; i < max_groups; i += blockDim.x) groups[i].nt = 0;
}

// The gated unit of the expert kernels: h = silu(g)·u, or (act 1) gpt-oss's clamped SwiGLU with g = min(g, 7),
// u = clamp(u, −7, 7): g·σ(1.702·g)·(u + 1) (ggml's swiglu_oai); with `gub` != null, routing entry p's expert
// (ids[p]) adds its gate and up biases first (gub: per expert, ff gate values then ff up values).
struct Glu {
    const int* ids;
    const float* gub;
    int act;
};

__device__ __forceinline__ float expert_glu(float gv, float uv, int p, int r, int ff, const Glu& a) {
    if (a.gub) {
        const float* b = a.gub + (size_t)a.ids[p] * 2 * ff;
        gv += b[r];
        uv += b[ff + r];
    }
    if (a.act == 1) {
        const float x = fminf(gv, 7.0f), y = fminf(fmaxf(uv, -7.0f), 7.0f);
        return x / (1.0f + expf(1.702f * -x)) * (y + 1.0f);
    }
    return gv / (1.0f + expf(-gv)) * uv;
}

// h[pair, r] = glu(gate_r · x_tok, up_r · x_tok) for r < ff (one warp: gate and up of one r).
// Grid: (ceil(ff / WARPS), n_groups).
template <int FMT, int NT>
__device__ void gate_up_body(const Group& g, const u8* blob, int ff, int e, const Q8* xq, const float* xf, float* h,
                             u8* stage, const Glu& gl) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + warp;
    if (r >= ff) return;
    const size_t rb = row_bytes(FMT, e);
    const u8* rp[2] = {blob + (size_t)r * rb, blob + (size_t)ff * rb + (size_t)r * rb};
    const Q8* xqs[NT];
    const float* xfs[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        xqs[t] = xq + (size_t)g.tok[t] * (e / 32);
        xfs[t] = xf + (size_t)g.tok[t] * e;
    }
    float acc[2][NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[0][t] = acc[1][t] = 0.f;
    rows_dot<FMT, NT, 2>(rp, e, rb, xqs, xfs, lane, stage + warp * (STAGE_BYTES(FMT) / WARPS), acc);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float gv = warp_sum(acc[0][t]);
        float uv = warp_sum(acc[1][t]);
        if (lane == 0) h[(size_t)g.pair[t] * ff + r] = expert_glu(gv, uv, g.pair[t], r, ff, gl);
    }
}

// The one-token gate/up product of narrow experts (e / 32 <= NARROW_GU_CB blocks per row, block formats): each
// warp takes the gate and up rows of two adjacent indices r0, r0 + 1 (four rows staged in chunks of NARROW_GU_CB
// blocks), twice gate_up_body's bytes in flight per warp and half its blocks. Same sums in the same order.
// Grid: (ceil(ff / (2 * WARPS)), n_groups).
#define NARROW_GU_CB (RPW * CB / 4)
template <int FMT>
__device__ void gate_up_narrow_body(const Group& g, const u8* blob, int ff, int e, const Q8* xq, const float* xf,
                                    float* h, u8* stage, const Glu& gl) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x * WARPS + warp) * 2;
    if (r0 >= ff) return;
    const size_t rb = row_bytes(FMT, e);
    const int r1 = min(r0 + 1, ff - 1);
    const u8* rp[4] = {blob + (size_t)r0 * rb, blob + (size_t)ff * rb + (size_t)r0 * rb, blob + (size_t)r1 * rb,
                       blob + (size_t)ff * rb + (size_t)r1 * rb};
    const Q8* xqs[1] = {xq + (size_t)g.tok[0] * (e / 32)};
    const float* xfs[1] = {xf + (size_t)g.tok[0] * e};
    float acc[4][1] = {{0.f}, {0.f}, {0.f}, {0.f}};
    u8* sm = stage + warp * (STAGE_BYTES(FMT) / WARPS);
    if (can_stage<FMT, 1, 4>(rp, e / 32, rb, xqs)) {
        rows_dot_staged<FMT, 1, 4, false, NARROW_GU_CB>(rp, e / 32, xqs, lane, sm, acc);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) row_dot<FMT, 1>(rp[j], e, xqs, xfs, lane, acc[j]);
    }
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const float gv = warp_sum(acc[2 * j][0]);
        const float uv = warp_sum(acc[2 * j + 1][0]);
        if (lane == 0 && r0 + j < ff) h[(size_t)g.pair[0] * ff + r0 + j] = expert_glu(gv, uv, g.pair[0], r0 + j, ff, gl);
    }
}

// out[pair, r] = down_r · h_pair for r < e (down rows start at `down_off` bytes into the blob, `rb` bytes
// apart: row_bytes(FMT, ff), or more for the padded parts of a PCIe split); each warp RPW adjacent rows. Grid:
// (ceil(e / (WARPS * RPW)), n_groups). `own` != null (NT == 1): the token's Q8 row of h, quantized by this
// block (instead of hq's row).
template <int FMT, int NT>
__device__ void down_body(const Group& g, const u8* blob, size_t down_off, size_t rb, int ff, int e, const Q8* hq,
                          const float* hf, float* out, u8* stage, const Q8* own = nullptr) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x * WARPS + warp) * RPW;
    if (r0 >= e) return;
    const u8* rp[RPW];
#pragma unroll
    for (int j = 0; j < RPW; j++) rp[j] = blob + down_off + (size_t)min(r0 + j, e - 1) * rb;
    const Q8* xqs[NT];
    const float* xfs[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
        xqs[t] = own ? own : hq + (size_t)g.pair[t] * (ff / 32);
        xfs[t] = hf + (size_t)g.pair[t] * ff;
    }
    float acc[RPW][NT];
#pragma unroll
    for (int j = 0; j < RPW; j++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[j][t] = 0.f;
    rows_dot<FMT, NT, RPW>(rp, ff, rb, xqs, xfs, lane, stage + warp * (STAGE_BYTES(FMT) / WARPS), acc);
#pragma unroll
    for (int j = 0; j < RPW; j++) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = warp_sum(acc[j][t]);
            if (lane == 0 && r0 + j < e) out[(size_t)g.pair[t] * e + r0 + j] = v;
        }
    }
}

#define NT_SWITCH(BODY, FMT, ...)                         \
    switch (g.nt) {                                       \
        case 0: break;                                    \
        case 1: BODY<FMT, 1>(__VA_ARGS__); break;         \
        case 2: BODY<FMT, 2>(__VA_ARGS__); break;         \
        case 3: BODY<FMT, 3>(__VA_ARGS__); break;         \
        case 4: BODY<FMT, 4>(__VA_ARGS__); break;         \
        case 5: BODY<FMT, 5>(__VA_ARGS__); break;         \
        case 6: BODY<FMT, 6>(__VA_ARGS__); break;         \
        case 7: BODY<FMT, 7>(__VA_ARGS__); break;         \
        default: BODY<FMT, 8>(__VA_ARGS__); break;        \
    }

// The block's threads quantize one row of n <= DOWN_OWN_MAX values (n % 32 == 0, 16-byte aligned) into the
// shared `dst`, one Q8 block per thread; returns dst once every block is written.
#define DOWN_OWN_MAX 2048
__device__ __forceinline__ const Q8* quantize_row_block(const float* src, int n, Q8* dst) {
    for (int b = threadIdx.x; b < n / 32; b += blockDim.x) {
        float v[32];
        const float4* s4 = (const float4*)(src + 32 * b);
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const float4 a = s4[q];
            v[4 * q] = a.x, v[4 * q + 1] = a.y, v[4 * q + 2] = a.z, v[4 * q + 3] = a.w;
        }
        quantize_block_thread(v, dst + b);
    }
    __syncthreads();
    return dst;
}

// Asks L2 for this warp's RPW down rows (as down_body picks them) while the block quantizes h.
__device__ __forceinline__ void prefetch_down_rows(const u8* down, size_t rb, int e) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x * WARPS + warp) * RPW;
    const int lines = (int)((rb + 127) / 128);
    for (int i = lane; i < RPW * lines; i += 32) {
        const int r = min(r0 + i / lines, e - 1);
        const u8* p = down + (size_t)r * rb + (size_t)(i % lines) * 128;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
}

// The one-token down product of narrow experts (ff / 32 <= NARROW_CB blocks per row, block formats): each warp
// takes NARROW_RPW adjacent rows and starts copying all their bytes into shared memory before it waits on the
// gate/up kernel (expert weights are no kernel's output, and the groups are final once that kernel runs: it
// lets this one launch only after its own wait), then the block quantizes its token's row of h into `hs`.
// With two rows of 24 blocks per warp (Qwen3-30B-A3B's 768-wide experts) the kernel had a quarter of each warp's
// staging space in flight and two dependent round trips per block. Same sums in the same order as down_body.
// Grid: (ceil(e / (WARPS * NARROW_RPW)), n_groups).
#define NARROW_RPW 8
#define NARROW_CB (RPW * CB / NARROW_RPW)
template <int FMT>
__device__ void down_narrow_body(const Group& g, const u8* blob, size_t down_off, size_t rb, int ff, int e,
                                 const float* hf, float* out, u8* stage, Q8* hs) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x * WARPS + warp) * NARROW_RPW;
    const int nb = ff / 32;
    const u8* rp[NARROW_RPW];
#pragma unroll
    for (int j = 0; j < NARROW_RPW; j++) rp[j] = blob + down_off + (size_t)min(r0 + j, e - 1) * rb;
    const Q8* xqs[1] = {hs};
    const float* xfs[1] = {hf + (size_t)g.pair[0] * ff};
    u8* sm = stage + warp * (STAGE_BYTES(FMT) / WARPS);
    // warps past the last row still take part in quantizing h (it ends in a block-wide barrier)
    const bool live = r0 < e;
    const bool staged = live && nb <= NARROW_CB && can_stage<FMT, 1, NARROW_RPW>(rp, nb, rb, xqs);
    if (staged) stage_first<FMT, NARROW_RPW, NARROW_CB>(rp, nb, lane, sm);
    pdl_wait();
    quantize_row_block(xfs[0], ff, hs);
    if (!live) return;
    float acc[NARROW_RPW][1];
#pragma unroll
    for (int j = 0; j < NARROW_RPW; j++) acc[j][0] = 0.f;
    if (staged) {
        rows_dot_staged<FMT, 1, NARROW_RPW, true, NARROW_CB>(rp, nb, xqs, lane, sm, acc);
    } else {
#pragma unroll
        for (int j = 0; j < NARROW_RPW; j++) row_dot<FMT, 1>(rp[j], ff, xqs, xfs, lane, acc[j]);
    }
#pragma unroll
    for (int j = 0; j < NARROW_RPW; j++) {
        const float v = warp_sum(acc[j][0]);
        if (lane == 0 && r0 + j < e) out[(size_t)g.pair[0] * e + r0 + j] = v;
    }
}

// The one-token gate/up kernels (`_t1`: one index per warp, `_t1n`: NARROW, two): each waits before it lets the
// next kernel launch, because the down kernel after it (the narrow one) reads its groups in its prologue.
template <int FMT, bool NARROW>
__device__ __forceinline__ void gate_up_one(const Group* groups, const u8* slots, size_t slot_bytes, int ff, int e,
                                            const Q8* xq, const float* xf, float* h, const Glu& gl) {
    pdl_wait();
    pdl_trigger();
    __shared__ __align__(16) u8 stage[STAGE_BYTES(FMT)];
    const Group g = groups[blockIdx.y];
    if (g.nt == 0) return;
    const u8* blob = slots + (size_t)g.slot * slot_bytes;
    if constexpr (NARROW) gate_up_narrow_body<FMT>(g, blob, ff, e, xq, xf, h, stage, gl);
    else gate_up_body<FMT, 1>(g, blob, ff, e, xq, xf, h, stage, gl);
}

// The one-token down kernels. `_t1`: waits on the previous kernel first; with hq == null it asks L2 for its rows
// and quantizes its token's row of h itself. NARROW (`_t1n`, down_narrow_body): reads its group and starts
// staging its rows before the wait (the gate/up kernel before it waited before letting it launch).
template <int FMT, bool NARROW>
__device__ __forceinline__ void down_one(const Group* groups, const u8* slots, size_t slot_bytes, size_t down_off,
                                         size_t down_rb, int ff, int e, const Q8* hq, const float* hf, float* out) {
    if (NARROW) pdl_trigger();
    else pdl_entry();
    __shared__ __align__(16) u8 stage[STAGE_BYTES(FMT)];
    __shared__ __align__(16) Q8 hs[DOWN_OWN_MAX / 32];
    const Group g = groups[blockIdx.y];
    if (g.nt == 0) return;
    const u8* blob = slots + (size_t)g.slot * slot_bytes;
    if constexpr (NARROW) {
        down_narrow_body<FMT>(g, blob, down_off, down_rb, ff, e, hf, out, stage, hs);
    } else {
        if (!hq) prefetch_down_rows(blob + down_off, down_rb, e);
        const Q8* own = hq ? nullptr : quantize_row_block(hf + (size_t)g.pair[0] * ff, ff, hs);
        down_body<FMT, 1>(g, blob, down_off, down_rb, ff, e, hq, hf, out, stage, own);
    }
}

// Decode (`_t1`) down kernels called with hq == null quantize their token's row of h themselves (ff <=
// DOWN_OWN_MAX): one launch less per MoE layer for narrow experts.
#define EXPERT_KERNELS(SUFFIX, FMT)                                                                               \
    extern "C" __global__ void expert_gate_up_##SUFFIX(const Group* groups, const u8* __restrict__ slots, size_t slot_bytes, \
                                                       int ff, int e, const Q8* xq, const float* xf, float* h,    \
                                                       const int* ids, const float* gub, int act) { pdl_entry();  \
        __shared__ __align__(16) u8 stage[STAGE_BYTES(FMT)];                                                      \
        const Group g = groups[blockIdx.y];                                                                       \
        const u8* blob = slots + (size_t)g.slot * slot_bytes;                                                     \
        const Glu gl{ids, gub, act};                                                                              \
        NT_SWITCH(gate_up_body, FMT, g, blob, ff, e, xq, xf, h, stage, gl)                                        \
    }                                                                                                             \
    extern "C" __global__ void expert_down_##SUFFIX(const Group* groups, const u8* __restrict__ slots, size_t slot_bytes, \
                                                    size_t down_off, size_t down_rb, int ff, int e, const Q8* hq, \
                                                    const float* hf, float* out) { pdl_entry();                    \
        __shared__ __align__(16) u8 stage[STAGE_BYTES(FMT)];                                                      \
        const Group g = groups[blockIdx.y];                                                                       \
        const u8* blob = slots + (size_t)g.slot * slot_bytes;                                                     \
        NT_SWITCH(down_body, FMT, g, blob, down_off, down_rb, ff, e, hq, hf, out, stage)                                          \
    }                                                                                                             \
    /* groups of at most one token (decode windows) */                                                            \
    extern "C" __global__ void expert_gate_up_##SUFFIX##_t1(const Group* groups, const u8* __restrict__ slots,    \
                                                            size_t slot_bytes, int ff, int e, const Q8* xq,       \
                                                            const float* xf, float* h, const int* ids,            \
                                                            const float* gub, int act) {                          \
        gate_up_one<FMT, false>(groups, slots, slot_bytes, ff, e, xq, xf, h, Glu{ids, gub, act});                 \
    }                                                                                                             \
    extern "C" __global__ void expert_down_##SUFFIX##_t1(const Group* groups, const u8* __restrict__ slots,       \
                                                         size_t slot_bytes, size_t down_off, size_t down_rb,      \
                                                         int ff, int e,                                           \
                                                         const Q8* hq, const float* hf, float* out) {             \
        down_one<FMT, false>(groups, slots, slot_bytes, down_off, down_rb, ff, e, hq, hf, out);                   \
    }

// The narrow one-token kernels (gate_up_narrow_body, down_narrow_body) of the block formats; the down kernel
// always quantizes h (ff <= DOWN_OWN_MAX) itself. The gate/up kernel waits before it lets the down kernel launch.
#define EXPERT_NARROW_KERNEL(SUFFIX, FMT)                                                                         \
    extern "C" __global__ void expert_gate_up_##SUFFIX##_t1n(const Group* groups, const u8* __restrict__ slots,   \
                                                             size_t slot_bytes, int ff, int e, const Q8* xq,      \
                                                             const float* xf, float* h, const int* ids,           \
                                                             const float* gub, int act) {                         \
        gate_up_one<FMT, true>(groups, slots, slot_bytes, ff, e, xq, xf, h, Glu{ids, gub, act});                  \
    }                                                                                                             \
    extern "C" __global__ void expert_down_##SUFFIX##_t1n(const Group* groups, const u8* __restrict__ slots,      \
                                                          size_t slot_bytes, size_t down_off, size_t down_rb,     \
                                                          int ff, int e, const Q8* hq, const float* hf,           \
                                                          float* out) {                                           \
        down_one<FMT, true>(groups, slots, slot_bytes, down_off, down_rb, ff, e, hq, hf, out);                    \
    }

EXPERT_KERNELS(f32, FMT_F32)
EXPERT_KERNELS(f16, FMT_F16)
EXPERT_KERNELS(bf16, FMT_BF16)
EXPERT_KERNELS(q8_0, FMT_Q8_0)
EXPERT_KERNELS(q4_0, FMT_Q4_0)
EXPERT_KERNELS(q4_1, FMT_Q4_1)
EXPERT_NARROW_KERNEL(q8_0, FMT_Q8_0)
EXPERT_NARROW_KERNEL(q4_0, FMT_Q4_0)
EXPERT_NARROW_KERNEL(q4_1, FMT_Q4_1)

// Tensor-core expert products over the tiles of group_by_expert (prefill chunks, every expert in VRAM): a tile is up
// to MQ_GPT consecutive groups of one expert (MQ_BN tokens), its columns the groups' entries in order. The gate/up
// kernel computes h[pair, r] = glu(gate_r · x_tok, up_r · x_tok) (expert_glu) for MQ_BM indices r per block (the gate and up
// rows of a warp's 16 indices side by side, two MMAs per column tile), the down kernel out[pair, r] = down_r · h_pair
// from h's Q8 rows (hq, by entry); arithmetic as mmq_body. Grid: (ceil(ff / MQ_BM) or ceil(e / MQ_BM), max_tiles).
__device__ __forceinline__ void mq_tile_cols(const Group* groups, int2 tl, bool by_pair, int* xrow, int* prow) {
    for (int c = threadIdx.x; c < MQ_BN; c += blockDim.x) {
        const int gi = c / MAX_NT, j = c % MAX_NT;
        int x = -1, p = -1;
        if (gi < tl.y) {
            const Group& gr = groups[tl.x + gi];
            if (j < gr.nt) {
                p = gr.pair[j];
                x = by_pair ? p : gr.tok[j];
            }
        }
        xrow[c] = x;
        prow[c] = p;
    }
}

template <int FMT>
__device__ void expert_gate_up_mmq_body(const Group* groups, const int2* tiles, const u8* slots, size_t slot_bytes,
                                        int ff, int e, const Q8* xq, float* h, const Glu gl) {
    __shared__ int xrow[MQ_BN], prow[MQ_BN];
    pdl_entry();
    const int2 tl = tiles[blockIdx.y];
    if (tl.y == 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
    const int ra = blockIdx.x * MQ_BM + warp * 16 + g, rb = ra + 8;
    const u8* blob = slots + (size_t)groups[tl.x].slot * slot_bytes;
    const size_t rbytes = row_bytes(FMT, e);
    const u8* rp[2] = {blob + (size_t)min(ra, ff - 1) * rbytes, blob + (size_t)min(rb, ff - 1) * rbytes};
    const u8* ru[2] = {rp[0] + (size_t)ff * rbytes, rp[1] + (size_t)ff * rbytes};
    mq_tile_cols(groups, tl, false, xrow, prow);
    const int nj = mq_live_tiles(tl.y * MAX_NT);
    float acc[MQ_BN / 8][4], accu[MQ_BN / 8][4];
    if constexpr (MQ_PIPE_FMT(FMT)) {
        extern __shared__ __align__(16) int mq_dyn[];
        __shared__ const u8* rowp[2 * MQ_BM];
        const int mode = mq_pipe_mode<FMT>((unsigned long long)blob | (unsigned long long)rbytes, e / 32);
        if (mode) {
            for (int i = threadIdx.x; i < MQ_BM; i += 32 * MQ_WARPS) {
                rowp[i] = blob + (size_t)min(blockIdx.x * MQ_BM + i, ff - 1) * rbytes;
                rowp[MQ_BM + i] = rowp[i] + (size_t)ff * rbytes;
            }
            __syncthreads();
            mq_core_pipe<FMT, true, true>(rowp, mode, e / 32, xq, e / 32, xrow, nj, (u8*)mq_dyn, acc, accu);
        } else {
            mq_core<FMT, true, true>(rp, ru, e / 32, xq, e / 32, xrow, nj, mq_dyn, acc, accu);
        }
    } else {
        __shared__ __align__(16) int xs[MQ_KB * MQ_BN * MQ_XS];
        mq_core<FMT, true, true>(rp, ru, e / 32, xq, e / 32, xrow, nj, xs, acc, accu);
    }
#pragma unroll
    for (int j = 0; j < MQ_BN / 8; j++) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = q < 2 ? ra : rb, p = prow[j * 8 + 2 * tg + (q & 1)];
            if (r < ff && p >= 0) {
                const float gv = acc[j][q], uv = accu[j][q];
                h[(size_t)p * ff + r] = expert_glu(gv, uv, p, r, ff, gl);
            }
        }
    }
}

template <int FMT>
__device__ void expert_down_mmq_body(const Group* groups, const int2* tiles, const u8* slots, size_t slot_bytes,
                                     size_t down_off, size_t down_rb, int ff, int e, const Q8* hq, float* out) {
    __shared__ int xrow[MQ_BN], prow[MQ_BN];
    pdl_entry();
    const int2 tl = tiles[blockIdx.y];
    if (tl.y == 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tg = lane % 4;
    const int ra = blockIdx.x * MQ_BM + warp * 16 + g, rb = ra + 8;
    const u8* down = slots + (size_t)groups[tl.x].slot * slot_bytes + down_off;
    const u8* rp[2] = {down + (size_t)min(ra, e - 1) * down_rb, down + (size_t)min(rb, e - 1) * down_rb};
    mq_tile_cols(groups, tl, true, xrow, prow);
    const int nj = mq_live_tiles(tl.y * MAX_NT);
    float acc[MQ_BN / 8][4], unused[MQ_BN / 8][4];
    if constexpr (MQ_PIPE_FMT(FMT)) {
        extern __shared__ __align__(16) int mq_dyn[];
        __shared__ const u8* rowp[MQ_BM];
        const int mode = mq_pipe_mode<FMT>((unsigned long long)down | (unsigned long long)down_rb, ff / 32);
        if (mode) {
            for (int i = threadIdx.x; i < MQ_BM; i += 32 * MQ_WARPS)
                rowp[i] = down + (size_t)min(blockIdx.x * MQ_BM + i, e - 1) * down_rb;
            __syncthreads();
            mq_core_pipe<FMT, false, true>(rowp, mode, ff / 32, hq, ff / 32, xrow, nj, (u8*)mq_dyn, acc, unused);
        } else {
            mq_core<FMT, false, true>(rp, rp, ff / 32, hq, ff / 32, xrow, nj, mq_dyn, acc, unused);
        }
    } else {
        __shared__ __align__(16) int xs[MQ_KB * MQ_BN * MQ_XS];
        mq_core<FMT, false, true>(rp, rp, ff / 32, hq, ff / 32, xrow, nj, xs, acc, unused);
    }
#pragma unroll
    for (int j = 0; j < MQ_BN / 8; j++) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = q < 2 ? ra : rb, p = prow[j * 8 + 2 * tg + (q & 1)];
            if (r < e && p >= 0) out[(size_t)p * e + r] = acc[j][q];
        }
    }
}

#define EXPERT_MMQ_KERNELS(SUFFIX, FMT)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * MQ_WARPS) expert_gate_up_mmq_##SUFFIX(                     \
        const Group* groups, const int2* tiles, const u8* __restrict__ slots, size_t slot_bytes, int ff, int e,     \
        const Q8* xq, float* h, const int* ids, const float* gub, int act) {                                      \
        expert_gate_up_mmq_body<FMT>(groups, tiles, slots, slot_bytes, ff, e, xq, h, Glu{ids, gub, act});         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * MQ_WARPS) expert_down_mmq_##SUFFIX(                        \
        const Group* groups, const int2* tiles, const u8* __restrict__ slots, size_t slot_bytes, size_t down_off,   \
        size_t down_rb, int ff, int e, const Q8* hq, float* out) {                                                \
        expert_down_mmq_body<FMT>(groups, tiles, slots, slot_bytes, down_off, down_rb, ff, e, hq, out);           \
    }
EXPERT_MMQ_KERNELS(q8_0, FMT_Q8_0)
EXPERT_MMQ_KERNELS(q4_0, FMT_Q4_0)
EXPERT_MMQ_KERNELS(q4_1, FMT_Q4_1)

// A shared expert's output added to the residual (Qwen2-MoE): x[i] += sigmoid(gw · xn[i]) * y[i] for each of
// the t rows of e values (gw: e weights of ffn_gate_inp_shexp; xn: the normalized FFN input). One block of
// QKV_PREP_THREADS threads per row.
extern "C" __global__ void gated_add(float* x, const float* y, const float* gw, const float* xn, int e) {
    pdl_entry();
    __shared__ float red[QKV_PREP_THREADS / 32];
    const size_t i = blockIdx.x;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    float d = 0.f;
    for (int j = tid; j < e; j += QKV_PREP_THREADS) d += gw[j] * xn[i * e + j];
    d = warp_sum(d);
    if (lane == 0) red[warp] = d;
    __syncthreads();
    float tot = 0.f;
    for (int k = 0; k < QKV_PREP_THREADS / 32; k++) tot += red[k];
    const float g = 1.0f / (1.0f + expf(-tot));
    for (int j = tid; j < e; j += QKV_PREP_THREADS) x[i * e + j] += g * y[i * e + j];
}

// The experts' down biases: y[p] += db[ids[p]] (e values) for each routing entry p of the n_groups groups (the
// entries the GPU computed; empty groups have none). Grid: (n_groups); block: 128 threads.
extern "C" __global__ void expert_down_bias(const Group* groups, float* y, const int* ids, const float* db, int e) {
    pdl_entry();
    const Group& g = groups[blockIdx.x];
    for (int j = 0; j < g.nt; j++) {
        const int p = g.pair[j];
        const float* b = db + (size_t)ids[p] * e;
        float* row = y + (size_t)p * e;
        for (int r = threadIdx.x; r < e; r += blockDim.x) row[r] += b[r];
    }
}

// x[i] += b for each of t rows of n values (a projection's bias). Grid: (t); block: 256 threads.
extern "C" __global__ void add_bias(float* x, const float* b, int n) {
    pdl_entry();
    float* row = x + (size_t)blockIdx.x * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) row[j] += b[j];
}

// Dense FFN activation: h[i] = silu(g[i]) * u[i] where gu holds t rows of [g (ff) | u (ff)].
extern "C" __global__ void swiglu(const float* gu, int ff, int t, float* h) {
    pdl_entry();
    const size_t n = (size_t)ff * t;
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t i = j / ff, c = j % ff;
        float g = gu[i * 2 * ff + c], u = gu[i * 2 * ff + ff + c];
        h[j] = g / (1.0f + expf(-g)) * u;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The sub-block formats' kernels, each compiled only into a module built with -DSTRATA_FMT_<suffix> (the host
// adds the formats its model uses; gpu-check all of them): dense products (one-token, small-batch, tensor-core
// prefill) and expert products (small-batch, one-token, tensor-core over the grouped tiles). Q2_K has no
// tensor-core kernels (per-16 minimums); its prefill takes the small-batch kernels.
#define SUB_FORMAT_ROW_KERNELS(SUFFIX, FMT) \
    MMV_KERNEL(mmv_##SUFFIX, FMT)           \
    EXPERT_KERNELS(SUFFIX, FMT)
#define SUB_FORMAT_KERNELS(SUFFIX, FMT)     \
    SUB_FORMAT_ROW_KERNELS(SUFFIX, FMT)     \
    MMQ_KERNEL(mmq_##SUFFIX, FMT)           \
    EXPERT_MMQ_KERNELS(SUFFIX, FMT)
#ifdef STRATA_FMT_q5_0
SUB_FORMAT_KERNELS(q5_0, FMT_Q5_0)
#endif
#ifdef STRATA_FMT_q5_1
SUB_FORMAT_KERNELS(q5_1, FMT_Q5_1)
#endif
#ifdef STRATA_FMT_q2_k
SUB_FORMAT_ROW_KERNELS(q2_k, FMT_Q2_K)
#endif
#ifdef STRATA_FMT_q3_k
SUB_FORMAT_KERNELS(q3_k, FMT_Q3_K)
#endif
#ifdef STRATA_FMT_q4_k
SUB_FORMAT_KERNELS(q4_k, FMT_Q4_K)
#endif
#ifdef STRATA_FMT_q5_k
SUB_FORMAT_KERNELS(q5_k, FMT_Q5_K)
#endif
#ifdef STRATA_FMT_q6_k
SUB_FORMAT_KERNELS(q6_k, FMT_Q6_K)
#endif
#ifdef STRATA_FMT_iq4_nl
SUB_FORMAT_KERNELS(iq4_nl, FMT_IQ4_NL)
#endif
#ifdef STRATA_FMT_iq4_xs
SUB_FORMAT_KERNELS(iq4_xs, FMT_IQ4_XS)
#endif
#ifdef STRATA_FMT_mxfp4
SUB_FORMAT_KERNELS(mxfp4, FMT_MXFP4)
#endif

#if defined(STRATA_FMT_iq2_xxs) || defined(STRATA_FMT_iq2_xs) || defined(STRATA_FMT_iq2_s) ||                  \
    defined(STRATA_FMT_iq3_xxs) || defined(STRATA_FMT_iq3_s) || defined(STRATA_FMT_iq1_s) ||                    \
    defined(STRATA_FMT_iq1_m)
// ggml's grids and ksigns_iq2xs, generated by the host from its format registry (quant/format/iq_grid.rs):
// iq2xxs_grid[256], iq2xs_grid[512], iq2s_grid[1024] (u64: 8 levels, value j in byte j), iq3xxs_grid[256],
// iq3s_grid[512] (u32: 4 levels), iq1s_grid8[2048] (u64: IQ1's levels −1, 0, 1 times 8), ksigns_iq2xs[128].
#include "strata_iq_grids.h"

// Four grid bytes g negated where bit k of signs (k < 4) is set.
__device__ __forceinline__ int iq_signed(u32 g, u32 signs) {
    const u32 m = (u32)spread4(signs) * 0xFFu;
    return (int)__vsub4(g ^ m, m);
}

// Word j of sub-block s: half j & 1 of the grid row j >> 1 (8 values) of the 2-bit grids, row j of the 4-value
// IQ3 grids; signs as ggml (ksigns_iq2xs of a 7-bit index, or a sign byte per 8 values); IQ1's rows are stored
// times 8 and take their ±1 offset (8 · (g ± 1/8), the scale carries the 1/8).
template <int F>
__device__ __forceinline__ int iq_word(const u8* b, int s, int j) {
    const int l = j >> 1, h = j & 1;
    if constexpr (F == FMT_IQ2_XXS) {
        const u32 a = (u32)ld_i32_a2(b + 2 + 8 * s), sc = (u32)ld_i32_a2(b + 6 + 8 * s);
        const u64 g = iq2xxs_grid[(a >> (8 * l)) & 0xFF];
        return iq_signed((u32)(g >> (32 * h)), (ksigns_iq2xs[(sc >> (7 * l)) & 0x7F] >> (4 * h)) & 0xF);
    } else if constexpr (F == FMT_IQ2_XS) {
        const u32 q = *(const u16*)(b + 2 + 8 * s + 2 * l);
        const u64 g = iq2xs_grid[q & 511];
        return iq_signed((u32)(g >> (32 * h)), (ksigns_iq2xs[q >> 9] >> (4 * h)) & 0xF);
    } else if constexpr (F == FMT_IQ2_S) {
        const u64 g = iq2s_grid[b[2 + 4 * s + l] | (((u32)b[66 + s] >> (2 * l)) & 3) << 8];
        return iq_signed((u32)(g >> (32 * h)), ((u32)b[34 + 4 * s + l] >> (4 * h)) & 0xF);
    } else if constexpr (F == FMT_IQ3_XXS) {
        const u32 sc = (u32)ld_i32_a2(b + 66 + 4 * s);
        return iq_signed(iq3xxs_grid[b[2 + 8 * s + j]], (ksigns_iq2xs[(sc >> (7 * l)) & 0x7F] >> (4 * h)) & 0xF);
    } else if constexpr (F == FMT_IQ3_S) {
        const u32 g = iq3s_grid[b[2 + 8 * s + j] | (((u32)b[66 + s] >> j) & 1) << 8];
        return iq_signed(g, ((u32)b[74 + 4 * s + l] >> (4 * h)) & 0xF);
    } else if constexpr (F == FMT_IQ1_S) {
        const u32 qh = *(const u16*)(b + 34 + 2 * s);
        const u64 g = iq1s_grid8[b[2 + 4 * s + l] | ((qh >> (3 * l)) & 7) << 8];
        return (int)__vadd4((u32)(g >> (32 * h)), (qh & 0x8000) ? 0xFFFFFFFFu : 0x01010101u);
    } else {  // IQ1_M
        const u32 nib = ((u32)b[32 + 2 * s + (l >> 1)] >> (4 * (l & 1))) & 0xF;
        const u64 g = iq1s_grid8[b[4 * s + l] | (nib & 7) << 8];
        return (int)__vadd4((u32)(g >> (32 * h)), (nib & 8) ? 0xFFFFFFFFu : 0x01010101u);
    }
}

// The scales of sub-block s: d · 2^-k · (2 s + 1) (IQ3_S: d · (2 s + 1)), one per 32 values or per 16 (SUB_HALVES).
template <int F>
__device__ __forceinline__ SubScales iq_scales(const u8* b, int s) {
    SubScales r;
    r.m0 = r.m1 = 0.f;
    if constexpr (F == FMT_IQ2_XXS || F == FMT_IQ3_XXS) {
        const u32 sc = (u32)ld_i32_a2(b + (F == FMT_IQ2_XXS ? 6 + 8 * s : 66 + 4 * s));
        r.d0 = r.d1 = h2f(b) * (F == FMT_IQ2_XXS ? 0.125f : 0.25f) * (float)(2 * (sc >> 28) + 1);
    } else if constexpr (F == FMT_IQ2_XS || F == FMT_IQ2_S) {
        const u32 sc = b[(F == FMT_IQ2_XS ? 66 : 74) + s];
        const float d = h2f(b) * 0.125f;
        r.d0 = d * (float)(2 * (sc & 0xF) + 1);
        r.d1 = d * (float)(2 * (sc >> 4) + 1);
    } else if constexpr (F == FMT_IQ3_S) {
        r.d0 = r.d1 = h2f(b) * (float)(2 * (((u32)b[106 + s / 2] >> (4 * (s & 1))) & 0xF) + 1);
    } else if constexpr (F == FMT_IQ1_S) {
        const u32 qh = *(const u16*)(b + 34 + 2 * s);
        r.d0 = r.d1 = h2f(b) * 0.125f * (float)(2 * ((qh >> 12) & 7) + 1);
    } else {  // IQ1_M: d in the top nibbles of the four scale words, a 3-bit scale per 16 values
        const u16* w = (const u16*)(b + 48);
        const u16 bits = (u16)((w[0] >> 12) | ((w[1] >> 8) & 0xF0) | ((w[2] >> 4) & 0xF00) | (w[3] & 0xF000));
        const float d = half_to_float(bits) * 0.125f;
        const int k = 2 * s;
        r.d0 = d * (float)(2 * ((w[k / 4] >> (3 * (k % 4))) & 7) + 1);
        r.d1 = d * (float)(2 * ((w[(k + 1) / 4] >> (3 * ((k + 1) % 4))) & 7) + 1);
    }
    return r;
}
#endif

#ifdef STRATA_FMT_iq2_xxs
SUB_FORMAT_KERNELS(iq2_xxs, FMT_IQ2_XXS)
#endif
#ifdef STRATA_FMT_iq2_xs
SUB_FORMAT_KERNELS(iq2_xs, FMT_IQ2_XS)
#endif
#ifdef STRATA_FMT_iq2_s
SUB_FORMAT_KERNELS(iq2_s, FMT_IQ2_S)
#endif
#ifdef STRATA_FMT_iq3_xxs
SUB_FORMAT_KERNELS(iq3_xxs, FMT_IQ3_XXS)
#endif
#ifdef STRATA_FMT_iq3_s
SUB_FORMAT_KERNELS(iq3_s, FMT_IQ3_S)
#endif
#ifdef STRATA_FMT_iq1_s
SUB_FORMAT_KERNELS(iq1_s, FMT_IQ1_S)
#endif
#ifdef STRATA_FMT_iq1_m
SUB_FORMAT_KERNELS(iq1_m, FMT_IQ1_M)
#endif
