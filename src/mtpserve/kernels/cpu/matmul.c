/*
 * Quantized matmul on GGUF blocks with llama.cpp's CPU numerics.
 *
 * Every activation row is first rounded to the weight type's "vec_dot type" (Q8_0/Q8_1 32-blocks or
 * Q8_K 256-blocks), then each output is built from exact integer block dot products, scaled in float
 * with the association llama.cpp's AVX2 build uses for that type and batch size:
 *  - 32-element types: eight float lanes, lane l holding bytes 4l..4l+3 of every block, one fused
 *    multiply-add per block, lanes summed ((0+4)+(2+6)) + ((1+5)+(3+7)); Q4_1/Q5_1 add m * s separately;
 *  - Q6_K: the same eight lanes per super-block (6-bit values unsigned, 32 * sum(scale * bsum) taken off);
 *  - Q4_K (repacked in llama.cpp): one sum per super-block, or per 64 values for whole groups of 4 rows;
 *  - batches of 8+ rows of Q6_K/Q5_K (llama.cpp's tiled path): one exact sum per super-block, scaled by
 *    the weight d, then multiplied into the accumulator with the activation d.
 * Sequences under 8 rows dot each weight row with every activation row. Sequences of 8+ rows (AVX2) go through
 * register tiles of 16 (AVX-512 VNNI) or 8 weight rows, one output per vector lane: the same exact integer sums,
 * and in every lane the float steps above in the same order, so the two paths agree bit for bit; so do several
 * short sequences together, of the types whose tiles give their numbers (tiles_take).
 */

#include "common.h"

#include <pthread.h>
#include <stdatomic.h>

#pragma pack(push, 1)
typedef struct { half d; uint8_t qs[16]; } blk_q4_0;                                            /* 18 */
typedef struct { half d, m; uint8_t qs[16]; } blk_q4_1;                                         /* 20 */
typedef struct { half d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;                             /* 22 */
typedef struct { half d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;                          /* 24 */
typedef struct { half d; int8_t qs[32]; } blk_q8_0;                                             /* 34 */
typedef struct { half d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;                 /* 144 */
typedef struct { half d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K; /* 176 */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; half d; } blk_q6_K;        /* 210 */
#pragma pack(pop)

/* GGML type ids (gguf GGMLQuantizationType) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

/* ---- activations --------------------------------------------------------------------------------- */

/* Q8_0 / Q8_1 activation block: d is the f16-rounded scale (as float); s = f16(d_f32 * sum(q)). */
typedef struct { float d; float s; int8_t qs[32]; } act_q8;
/* Q8_K activation block: f32 scale, sums of each 16 quants. */
typedef struct { float d; int16_t bsums[16]; int8_t qs[256]; } act_q8k;

#ifdef MTP_AVX2
/* max |x[j]| over n floats (n a multiple of 32), as the scalar loops find it: the max is order-free, NaNs skipped */
static inline float amax32(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < n; j += 32)
        for (int i = 0; i < 4; i++) a[i] = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j + 8 * i)), a[i]);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* index of the first |x[j]| == a (one exists): the value the scalar loop keeps as the max */
static inline int first_of_magnitude(const float *x, float a) {
    const __m256 sign = _mm256_set1_ps(-0.0f), va = _mm256_set1_ps(a);
    for (int j = 0;; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), va, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
}

/* round_half_even(x[0..7] * s) as int32: nearbyintf's rounding */
static inline __m256i round8(const float *x, __m256 s) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* the byte the scalar (int8_t) cast keeps: INT32_MIN (rounded NaN or inf) -> 0, others are in -128..127 already */
static inline __m256i int8_value(__m256i q) { return _mm256_andnot_si256(_mm256_cmpeq_epi32(q, _mm256_set1_epi32(INT32_MIN)), q); }

/* 32 int32 (four vectors, in -128..127) as bytes in order */
static inline void pack32(const __m256i v[4], int8_t *out) {
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline int32_t hsum_v8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* llama.cpp x86 quantize_row_q8_0/q8_1: d = amax/127, q = round_half_even(x * (127/amax)). */
static void quantize_q8(const float *x, int64_t k, act_q8 *y) {
#ifdef MTP_AVX2
    for (int64_t b = 0; b < k / 32; b++, x += 32) {
        const float amax = amax32(x, 32);
        const float d = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4], q8[4];
        for (int v = 0; v < 4; v++) q8[v] = int8_value(q[v] = round8(x + 8 * v, id));
        pack32(q8, y[b].qs);
        /* s sums the ints, as the scalar loop does (they differ from the bytes only for NaN or inf) */
        const int sum = hsum_v8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        y[b].d = h2f(f2h(d));
        y[b].s = h2f(f2h(d * (float)sum));
    }
    return;
#endif
    for (int64_t b = 0; b < k / 32; b++, x += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            const int q = (int)nearbyintf(x[j] * id);
            y[b].qs[j] = (int8_t)q;
            sum += q;
        }
        y[b].d = h2f(f2h(d));
        y[b].s = h2f(f2h(d * (float)sum));
    }
}

/* llama.cpp quantize_row_q8_K: iscale = -127/max (max = the signed value of largest magnitude, the
 * first one on ties), q = min(127, round_half_even(iscale * x)), d = 1/iscale. */
static void quantize_q8k(const float *x, int64_t k, act_q8k *y) {
#ifdef MTP_AVX2
    for (int64_t b = 0; b < k / 256; b++, x += 256) {
        const float amax = amax32(x, 256);
        if (amax == 0.0f) {
            memset(&y[b], 0, sizeof(act_q8k));
            continue;
        }
        const float iscale = -127.0f / x[first_of_magnitude(x, amax)];
        const __m256 s = _mm256_set1_ps(iscale);
        for (int g = 0; g < 8; g++) {
            __m256i q[4];
            for (int v = 0; v < 4; v++) q[v] = int8_value(_mm256_min_epi32(round8(x + 32 * g + 8 * v, s), _mm256_set1_epi32(127)));
            pack32(q, y[b].qs + 32 * g);
            y[b].bsums[2 * g] = (int16_t)hsum_v8(_mm256_add_epi32(q[0], q[1]));
            y[b].bsums[2 * g + 1] = (int16_t)hsum_v8(_mm256_add_epi32(q[2], q[3]));
        }
        y[b].d = 1.0f / iscale;
    }
    return;
#endif
    for (int64_t b = 0; b < k / 256; b++, x += 256) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < 256; j++) {
            const float a = fabsf(x[j]);
            if (a > amax) { amax = a; max = x[j]; }
        }
        if (amax == 0.0f) {
            memset(&y[b], 0, sizeof(act_q8k));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < 256; j++) {
            const int q = (int)nearbyintf(iscale * x[j]);
            y[b].qs[j] = (int8_t)(q < 127 ? q : 127);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += y[b].qs[16 * j + i];
            y[b].bsums[j] = (int16_t)sum;
        }
        y[b].d = 1.0f / iscale;
    }
}

/* ---- integer lanes ----------------------------------------------------------------------------------- */

/* lane[l] = sum of w[i] * x[i] over bytes i = 4l..4l+3 of 32; w unsigned (0..255) or signed. */
static inline void lanes_us(const uint8_t *w, const int8_t *x, int32_t lane[8]) {
#ifdef MTP_AVX2
    const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)w), _mm256_loadu_si256((const __m256i *)x));
    _mm256_storeu_si256((__m256i *)lane, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#else
    for (int l = 0; l < 8; l++) lane[l] = w[4 * l] * x[4 * l] + w[4 * l + 1] * x[4 * l + 1] + w[4 * l + 2] * x[4 * l + 2] + w[4 * l + 3] * x[4 * l + 3];
#endif
}

static inline void lanes_ss(const int8_t *w, const int8_t *x, int32_t lane[8]) {
#ifdef MTP_AVX2
    const __m256i a = _mm256_loadu_si256((const __m256i *)w), b = _mm256_loadu_si256((const __m256i *)x);
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    _mm256_storeu_si256((__m256i *)lane, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#else
    for (int l = 0; l < 8; l++) lane[l] = w[4 * l] * x[4 * l] + w[4 * l + 1] * x[4 * l + 1] + w[4 * l + 2] * x[4 * l + 2] + w[4 * l + 3] * x[4 * l + 3];
#endif
}

#ifdef MTP_AVX2
static inline __m256i nibbles32(const uint8_t *qs) { /* 16 bytes -> 32: low nibbles, then high nibbles */
    const __m128i tmp = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp), _mm256_set1_epi8(15));
}
static inline __m256i bits32(const uint8_t *qh) { /* 4 bytes -> 32 bytes of 0xFF / 0x00 per bit */
    uint32_t x32;
    memcpy(&x32, qh, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}
#endif

static inline int32_t hsum_i32(const int32_t lane[8]) {
    return lane[0] + lane[1] + lane[2] + lane[3] + lane[4] + lane[5] + lane[6] + lane[7];
}

/* ---- decoded weight rows ------------------------------------------------------------------------------ */

typedef struct {
    int8_t *q;        /* one byte per weight (signed for Q4_0/Q5_0/Q8_0, unsigned otherwise) */
    float *d, *m;     /* per 32-block scale and min (32-element types); per super-block d, dmin (K-quants) */
    int32_t *sc, *mn; /* K-quants: per sub-block scale (16 per super-block for Q6_K, 8 otherwise) and min */
} wrow;

static void wrow_alloc(wrow *r, int64_t k) {
    r->q = aligned_alloc(64, (size_t)((k + 63) / 64 * 64));
    r->d = malloc(sizeof(float) * (k / 32 + 1));
    r->m = malloc(sizeof(float) * (k / 32 + 1));
    r->sc = malloc(sizeof(int32_t) * (k / 16 + 1));
    r->mn = malloc(sizeof(int32_t) * (k / 16 + 1));
}

static void wrow_free(wrow *r) {
    free(r->q);
    free(r->d);
    free(r->m);
    free(r->sc);
    free(r->mn);
}

static inline void k_scale_min(int j, const uint8_t *q, int32_t *sc, int32_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Element order: the GGUF dequantization order (element j of block b at q[32b + j], or 256b + j). */
static void decode_row(int type, const uint8_t *src, int64_t k, wrow *r) {
    int8_t *q = r->q;
    switch (type) {
        case T_Q4_0: {
            const blk_q4_0 *w = (const blk_q4_0 *)src;
            for (int64_t b = 0; b < k / 32; b++, q += 32) {
                r->d[b] = h2f(w[b].d);
#ifdef MTP_AVX2
                _mm256_storeu_si256((__m256i *)q, _mm256_sub_epi8(nibbles32(w[b].qs), _mm256_set1_epi8(8)));
#else
                for (int j = 0; j < 16; j++) { q[j] = (int8_t)((w[b].qs[j] & 15) - 8); q[j + 16] = (int8_t)((w[b].qs[j] >> 4) - 8); }
#endif
            }
        } break;
        case T_Q4_1: {
            const blk_q4_1 *w = (const blk_q4_1 *)src;
            for (int64_t b = 0; b < k / 32; b++, q += 32) {
                r->d[b] = h2f(w[b].d);
                r->m[b] = h2f(w[b].m);
#ifdef MTP_AVX2
                _mm256_storeu_si256((__m256i *)q, nibbles32(w[b].qs));
#else
                for (int j = 0; j < 16; j++) { q[j] = (int8_t)(w[b].qs[j] & 15); q[j + 16] = (int8_t)(w[b].qs[j] >> 4); }
#endif
            }
        } break;
        case T_Q5_0:
        case T_Q5_1: {
            const int has_min = type == T_Q5_1;
            const int64_t bs = has_min ? 24 : 22;
            for (int64_t b = 0; b < k / 32; b++, q += 32) {
                const uint8_t *blk = src + b * bs;
                const uint8_t *qh8 = blk + (has_min ? 4 : 2), *qs = blk + (has_min ? 8 : 6);
                uint32_t qh;
                memcpy(&qh, qh8, 4);
                half hd, hm;
                memcpy(&hd, blk, 2);
                r->d[b] = h2f(hd);
                if (has_min) { memcpy(&hm, blk + 2, 2); r->m[b] = h2f(hm); }
                const int off = has_min ? 0 : 16;
#ifdef MTP_AVX2
                const __m256i v = _mm256_or_si256(nibbles32(qs), _mm256_and_si256(bits32(qh8), _mm256_set1_epi8(16)));
                _mm256_storeu_si256((__m256i *)q, _mm256_sub_epi8(v, _mm256_set1_epi8((char)off)));
#else
                for (int j = 0; j < 16; j++) {
                    q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - off);
                    q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
                }
#endif
            }
        } break;
        case T_Q8_0: {
            const blk_q8_0 *w = (const blk_q8_0 *)src;
            for (int64_t b = 0; b < k / 32; b++, q += 32) {
                r->d[b] = h2f(w[b].d);
                memcpy(q, w[b].qs, 32);
            }
        } break;
        case T_Q4_K:
        case T_Q5_K: {
            const int five = type == T_Q5_K;
            for (int64_t b = 0; b < k / 256; b++, q += 256) {
                const uint8_t *blk = src + b * (five ? 176 : 144);
                const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + (five ? 48 : 16);
                half hd, hdm;
                memcpy(&hd, blk, 2);
                memcpy(&hdm, blk + 2, 2);
                r->d[b] = h2f(hd);
                r->m[b] = h2f(hdm);
                for (int j = 0; j < 8; j++) k_scale_min(j, scales, &r->sc[8 * b + j], &r->mn[8 * b + j]);
#ifdef MTP_AVX2
                const __m256i m4 = _mm256_set1_epi8(15), h = _mm256_loadu_si256((const __m256i *)qh);
                for (int c = 0; c < 4; c++) { /* bit 2c (2c + 1) of qh[l] moved to bit 4: shift 16-bit lanes, keep bit 4 of each byte */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    if (five) {
                        const __m256i b16 = _mm256_set1_epi8(16);
                        const __m256i hlo = 2 * c <= 4 ? _mm256_slli_epi16(h, 4 - 2 * c) : _mm256_srli_epi16(h, 2 * c - 4);
                        const __m256i hhi = 2 * c + 1 <= 4 ? _mm256_slli_epi16(h, 3 - 2 * c) : _mm256_srli_epi16(h, 2 * c - 3);
                        lo = _mm256_or_si256(lo, _mm256_and_si256(hlo, b16));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(hhi, b16));
                    }
                    _mm256_storeu_si256((__m256i *)(q + 64 * c), lo);
                    _mm256_storeu_si256((__m256i *)(q + 64 * c + 32), hi);
                }
                continue;
#endif
                for (int c = 0; c < 4; c++)
                    for (int l = 0; l < 32; l++) {
                        int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
                        if (five) {
                            lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                            hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                        }
                        q[64 * c + l] = (int8_t)lo;
                        q[64 * c + 32 + l] = (int8_t)hi;
                    }
            }
        } break;
        case T_Q6_K: {
            const blk_q6_K *w = (const blk_q6_K *)src;
            for (int64_t b = 0; b < k / 256; b++, q += 256) {
                r->d[b] = h2f(w[b].d);
                for (int j = 0; j < 16; j++) r->sc[16 * b + j] = w[b].scales[j];
#ifdef MTP_AVX2
                const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
                for (int n = 0; n < 2; n++) { /* unsigned 0..63; the -32 is taken off through the bsums */
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(w[b].qh + 32 * n));
                    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w[b].ql + 64 * n));
                    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w[b].ql + 64 * n + 32));
                    __m256i *o = (__m256i *)(q + 128 * n);
                    _mm256_storeu_si256(o, _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)));
                    _mm256_storeu_si256(o + 1, _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)));
                    _mm256_storeu_si256(o + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)));
                    _mm256_storeu_si256(o + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4)));
                }
                continue;
#endif
                for (int n = 0; n < 2; n++) {
                    const uint8_t *ql = w[b].ql + 64 * n, *qh = w[b].qh + 32 * n;
                    int8_t *o = q + 128 * n;
                    for (int l = 0; l < 32; l++) { /* unsigned 0..63; the -32 is taken off through the bsums */
                        o[l] = (int8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                        o[l + 32] = (int8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                        o[l + 64] = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                        o[l + 96] = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                    }
                }
            }
        } break;
    }
}

/* ---- dot products of a decoded row with one activation row ------------------------------------------- */

/* 32-element types: acc[l] = fma(d_w d_x, lane[l], acc[l]) per block; Q4_1/Q5_1 also m_w * s_x (fused). */
static float dot32(const wrow *r, const act_q8 *x, int64_t nb, int is_signed, int has_min) {
#ifdef MTP_AVX2
    __m256 vacc = _mm256_setzero_ps();
    float vsumms = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(r->q + 32 * b));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i p = is_signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                                    : _mm256_maddubs_epi16(w, xv);
        if (has_min) vsumms = fmaf(r->m[b], x[b].s, vsumms);
        const __m256 lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
        vacc = _mm256_fmadd_ps(_mm256_set1_ps(r->d[b] * x[b].d), lanes, vacc);
    }
    float out[8];
    _mm256_storeu_ps(out, vacc);
    return hsum8(out) + vsumms;
#endif
    float acc[8] = {0}, summs = 0.0f;
    int32_t lane[8];
    for (int64_t b = 0; b < nb; b++) {
        if (is_signed) lanes_ss(r->q + 32 * b, x[b].qs, lane);
        else lanes_us((const uint8_t *)r->q + 32 * b, x[b].qs, lane);
        if (has_min) summs = fmaf(r->m[b], x[b].s, summs);
        const float d = r->d[b] * x[b].d;
        for (int l = 0; l < 8; l++) acc[l] = fmaf(d, (float)lane[l], acc[l]);
    }
    return hsum8(acc) + summs;
}

/* Q4_K/Q5_K sums of one super-block: per 64 values (c = 0..3) the scaled integer dot and min term. */
static inline void k4_sums(const wrow *r, const act_q8k *x, int64_t b, int32_t sumi[4], int32_t summ[4]) {
    int32_t lane[8];
    const uint8_t *q = (const uint8_t *)r->q + 256 * b;
    for (int c = 0; c < 4; c++) {
        lanes_us(q + 64 * c, x[b].qs + 64 * c, lane);
        const int32_t lo = hsum_i32(lane);
        lanes_us(q + 64 * c + 32, x[b].qs + 64 * c + 32, lane);
        const int32_t hi = hsum_i32(lane);
        sumi[c] = r->sc[8 * b + 2 * c] * lo + r->sc[8 * b + 2 * c + 1] * hi;
        summ[c] = r->mn[8 * b + 2 * c] * (x[b].bsums[4 * c] + x[b].bsums[4 * c + 1]) +
                  r->mn[8 * b + 2 * c + 1] * (x[b].bsums[4 * c + 2] + x[b].bsums[4 * c + 3]);
    }
}

/* kind: 0 = llama.cpp's repacked gemv (one float step per super-block), 1 = its 4-row gemm (per 64
 * values), 2 = its tiled path (res = d_w sumi - dmin_w summ, then acc += res d_x) */
static float dot_k4(const wrow *r, const act_q8k *x, int64_t nb, int kind) {
    float acc = 0.0f, accm = 0.0f;
    int32_t sumi[4], summ[4];
    for (int64_t b = 0; b < nb; b++) {
        k4_sums(r, x, b, sumi, summ);
        if (kind == 1) {
            const float d = r->d[b] * x[b].d, dmin = r->m[b] * x[b].d;
            for (int c = 0; c < 4; c++) {
                acc = fmaf((float)sumi[c], d, acc);
                accm = fmaf((float)summ[c], dmin, accm);
            }
            continue;
        }
        const int32_t si = sumi[0] + sumi[1] + sumi[2] + sumi[3], sm = summ[0] + summ[1] + summ[2] + summ[3];
        if (kind == 0) {
            acc = fmaf((float)si, r->d[b] * x[b].d, acc);
            accm = fmaf((float)sm, r->m[b] * x[b].d, accm);
        } else {
            acc = fmaf(fmaf(-r->m[b], (float)sm, r->d[b] * (float)si), x[b].d, acc);
        }
    }
    return acc - accm;
}

/* Q6_K lanes of one super-block: lane[l] = sum over the 8 vectors of 32 values of scale * (bytes
 * 4l..4l+3 dot), minus 32 (sc[2l] bsum[2l] + sc[2l+1] bsum[2l+1]). */
static inline void k6_lanes(const wrow *r, const act_q8k *x, int64_t b, int32_t out[8]) {
    const uint8_t *q = (const uint8_t *)r->q + 256 * b;
    const int32_t *sc = r->sc + 16 * b;
#ifdef MTP_AVX2
    __m256i sum = _mm256_setzero_si256();
    for (int v = 0; v < 8; v++) {
        const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * v)),
                                               _mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * v)));
        const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((short)sc[2 * v + 1]), _mm_set1_epi16((short)sc[2 * v]));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, scales));
    }
    _mm256_storeu_si256((__m256i *)out, sum);
    for (int l = 0; l < 8; l++) out[l] -= 32 * (x[b].bsums[2 * l] * sc[2 * l] + x[b].bsums[2 * l + 1] * sc[2 * l + 1]);
    return;
#endif
    for (int l = 0; l < 8; l++) out[l] = -32 * (x[b].bsums[2 * l] * sc[2 * l] + x[b].bsums[2 * l + 1] * sc[2 * l + 1]);
    int32_t lane[8];
    for (int v = 0; v < 8; v++) { /* 32 values each: scale index 2v for bytes 0..15, 2v + 1 for 16..31 */
        lanes_us(q + 32 * v, x[b].qs + 32 * v, lane);
        for (int l = 0; l < 8; l++) out[l] += sc[2 * v + (l >= 4)] * lane[l];
    }
}

static float dot_k6(const wrow *r, const act_q8k *x, int64_t nb, int tiled) {
    float acc[8] = {0}, acc1 = 0.0f;
    int32_t lane[8];
    for (int64_t b = 0; b < nb; b++) {
        k6_lanes(r, x, b, lane);
        if (tiled) {
            acc1 = fmaf(r->d[b] * (float)hsum_i32(lane), x[b].d, acc1);
        } else {
            const float d = x[b].d * r->d[b];
            for (int l = 0; l < 8; l++) acc[l] = fmaf(d, (float)lane[l], acc[l]);
        }
    }
    return tiled ? acc1 : hsum8(acc);
}

/* ---- matmul ----------------------------------------------------------------------------------- */

static int64_t row_bytes(int type, int64_t k) {
    switch (type) {
        case T_F32: return 4 * k;
        case T_F16: return 2 * k;
        case T_Q4_0: return k / 32 * 18;
        case T_Q4_1: return k / 32 * 20;
        case T_Q5_0: return k / 32 * 22;
        case T_Q5_1: return k / 32 * 24;
        case T_Q8_0: return k / 32 * 34;
        case T_Q4_K: return k / 256 * 144;
        case T_Q5_K: return k / 256 * 176;
        case T_Q6_K: return k / 256 * 210;
        default: return -1;
    }
}

static int64_t row_block(int type) {
    return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K ? 256 : 32;
}

int mtp_matmul_supported(int type) { return row_bytes(type, 256) > 0; }

/* ---- fused paths for small batches (AVX2): dot straight from the GGUF block, no decoded row ---------- */
#ifdef MTP_AVX2
/* The 32 weight bytes of a 32-element block as dot32 sees them (signed for Q4_0/Q5_0/Q8_0). */
static inline __m256i load_q32(int type, const uint8_t *blk, float *d, float *m) {
    half hd, hm;
    memcpy(&hd, blk, 2);
    *d = h2f(hd);
    switch (type) {
        case T_Q4_0: return _mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8));
        case T_Q4_1: memcpy(&hm, blk + 2, 2); *m = h2f(hm); return nibbles32(blk + 4);
        case T_Q5_0:
            return _mm256_sub_epi8(_mm256_or_si256(nibbles32(blk + 6), _mm256_and_si256(bits32(blk + 2), _mm256_set1_epi8(16))),
                                   _mm256_set1_epi8(16));
        case T_Q5_1:
            memcpy(&hm, blk + 2, 2);
            *m = h2f(hm);
            return _mm256_or_si256(nibbles32(blk + 8), _mm256_and_si256(bits32(blk + 4), _mm256_set1_epi8(16)));
        default: return _mm256_loadu_si256((const __m256i *)(blk + 2)); /* Q8_0 */
    }
}

/* Decode streams each weight once: the direct dots ask for the bytes this far ahead of the block they read (the
 * rest of the row and the next rows: rows are contiguous; a prefetch past the matrix's end faults nothing). On the
 * 2-core Intel AVX-512 VM the hardware prefetchers alone left a decode waiting on nearly every block: SmolLM2's
 * 1-thread decode 40.5 t/s, 65 / 78 / 90-96 / 98-105 / 98 at 512 / 1024 / 2048 / 4096 / 8192 bytes ahead
 * (docs/performance.md#streamed-responses). */
#define PREFETCH_AHEAD 4096
/* every 64-byte line of [p, p + n) asked for */
static inline void prefetch_lines(const uint8_t *p, int n) {
    for (int i = 0; i < n; i += 64) __builtin_prefetch(p + i);
}
/* The four-row dots read four streams at once, row r of a group of four being one; a fixed distance ahead in memory
 * (PREFETCH_AHEAD) lands in the group's own next row, which is being read already. Each row asks instead for its
 * block `ahead` blocks on (x4_ahead: ~X4_AHEAD_BYTES, at most a row), and past its row's end for that block of the
 * same row of the next group (rows are contiguous, rb bytes apart). The 27B's matrices streamed from memory on the
 * 2-core Intel VM, 2 threads: Q4_K 15.1 -> 21.3 GB/s (ffn_up, ffn_gate, attn_qkv), Q6_K ffn_down 17.3 (one row at a
 * time) -> 26.9, a 2-thread torch.sum reading 24-27 GB/s; 4, 8 and 16 blocks ahead within 4% (docs/performance.md). */
#define X4_AHEAD_BYTES 1152
static inline int64_t x4_ahead(int bs, int64_t nb) { return X4_AHEAD_BYTES / bs < nb ? X4_AHEAD_BYTES / bs : nb; }
static inline void prefetch_x4(const uint8_t *blk, int bs, int64_t ahead, int64_t b, int64_t nb, int64_t rb) {
    prefetch_lines(blk + bs * ahead + (b + ahead >= nb ? 3 * rb : 0), bs);
}
static float dot32_direct(int type, const uint8_t *src, const act_q8 *x, int64_t nb) {
    const int64_t bs = row_bytes(type, 32);
    const int is_signed = type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0;
    __m256 vacc = _mm256_setzero_ps();
    float vsumms = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        float d, m = 0.0f;
        prefetch_lines(src + b * bs + PREFETCH_AHEAD, (int)bs);
        const __m256i w = load_q32(type, src + b * bs, &d, &m);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i u = is_signed ? _mm256_sign_epi8(w, w) : w, sx = is_signed ? _mm256_sign_epi8(xv, w) : xv;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) /* the same exact lane sums in one instruction */
        const __m256i lanes_i = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, sx);
#else
        const __m256i lanes_i = _mm256_madd_epi16(_mm256_maddubs_epi16(u, sx), _mm256_set1_epi16(1));
#endif
        if (!is_signed) vsumms = fmaf(m, x[b].s, vsumms);
        vacc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), _mm256_cvtepi32_ps(lanes_i), vacc);
    }
    float out[8];
    _mm256_storeu_ps(out, vacc);
    return hsum8(out) + vsumms;
}

/* dot32_direct of four rows at once (row stride rb), for decode: row r's lanes and float steps are dot32_direct's;
 * the activation block is loaded once for the four rows. */
static inline __attribute__((always_inline)) void dot32_direct_x4(int type, const uint8_t *src, int64_t rb, const act_q8 *x,
                                                                 int64_t nb, float *out) {
    const int bs = (int)row_bytes(type, 32);
    const int64_t ahead = x4_ahead(bs, nb);
    const int is_signed = type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0;
    __m256 vacc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float vsumms[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)x[b].qs);
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = src + r * rb + b * bs;
            prefetch_x4(blk, bs, ahead, b, nb, rb);
            float d, m = 0.0f;
            const __m256i w = load_q32(type, blk, &d, &m);
            const __m256i u = is_signed ? _mm256_sign_epi8(w, w) : w, sx = is_signed ? _mm256_sign_epi8(xv, w) : xv;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            const __m256i lanes_i = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, sx);
#else
            const __m256i lanes_i = _mm256_madd_epi16(_mm256_maddubs_epi16(u, sx), _mm256_set1_epi16(1));
#endif
            if (!is_signed) vsumms[r] = fmaf(m, x[b].s, vsumms[r]);
            vacc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), _mm256_cvtepi32_ps(lanes_i), vacc[r]);
        }
    }
    for (int r = 0; r < 4; r++) {
        float acc[8];
        _mm256_storeu_ps(acc, vacc[r]);
        out[r] = hsum8(acc) + vsumms[r];
    }
}

/* The eight 6-bit scales (bytes 0..7 of *sc) and mins (bytes 0..7 of *mn) of a Q4_K/Q5_K super-block,
 * unpacked with 32-bit masks: scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 / 4-7; scales and
 * mins 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from the top of bytes 0-3 / 4-7. */
static inline void k_scales_mins8(const uint8_t *packed, uint64_t *sc, uint64_t *mn) {
    uint32_t u[3]; /* three loads into registers (a 12-byte memcpy went through the stack) */
    memcpy(&u[0], packed, 4);
    memcpy(&u[1], packed + 4, 4);
    memcpy(&u[2], packed + 8, 4);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    const uint32_t sc_lo = u[0] & low6, mn_lo = u[1] & low6;
    const uint32_t sc_hi = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
    *sc = (uint64_t)sc_lo | ((uint64_t)sc_hi << 32);
    *mn = (uint64_t)mn_lo | ((uint64_t)mn_hi << 32);
}

/* Scale v of eight 16-bit scales (in both halves of sc16) in every 16-bit lane: a byte shuffle (llama.cpp's way),
 * one instruction where a set1 from memory took three. */
static inline __m256i scale_k(__m256i sc16, int v) { return _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * v))); }

/* A Q4_K super-block's header: d and dmin, its eight scales widened to 16 bits in both halves of *sc16 (for scale_k),
 * its eight mins widened in *mins. */
static inline void q4k_header(const uint8_t *blk, float *d, float *dmin, __m256i *sc16, __m128i *mins) {
    half hd, hdm;
    memcpy(&hd, blk, 2);
    memcpy(&hdm, blk + 2, 2);
    *d = h2f(hd);
    *dmin = h2f(hdm);
    uint64_t sc64, mn64;
    k_scales_mins8(blk + 4, &sc64, &mn64);
    *sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc64)));
    *mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn64));
}

/* dot_k4 (kinds 0 and 1) from the block bytes; the integer sums are exact, so their order is free. */
static float dot_q4k_direct(const uint8_t *src, const act_q8k *x, int64_t nb, int kind) {
    float acc = 0.0f, accm = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = src + 144 * b, *qs = blk + 16;
        prefetch_lines(blk + PREFETCH_AHEAD, 144);
        float wd, wdmin;
        __m256i sc16;
        __m128i mins;
        q4k_header(blk, &wd, &wdmin, &sc16, &mins);
        /* mins: sum_j mn[j] * (bsums[2j] + bsums[2j + 1]) */
        const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)x[b].bsums), _mm_loadu_si128((const __m128i *)(x[b].bsums + 8)));
        const __m128i prod_m = _mm_madd_epi16(mins, bs); /* 4 x int32: c = 0..3 */
        __m256i total = _mm256_setzero_si256();
        int32_t sumi[4];
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(v, m4), _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * c)));
            const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                                    _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * c + 32)));
            const __m256i part = _mm256_add_epi32(_mm256_madd_epi16(lo, scale_k(sc16, 2 * c)), _mm256_madd_epi16(hi, scale_k(sc16, 2 * c + 1)));
            if (kind == 1) sumi[c] = hsum_v8(part);
            else total = _mm256_add_epi32(total, part);
        }
        const float d = wd * x[b].d, dmin = wdmin * x[b].d;
        if (kind == 1) {
            int32_t summ[4];
            _mm_storeu_si128((__m128i *)summ, prod_m);
            for (int c = 0; c < 4; c++) {
                acc = fmaf((float)sumi[c], d, acc);
                accm = fmaf((float)summ[c], dmin, accm);
            }
        } else {
            __m128i sm = _mm_add_epi32(prod_m, _mm_shuffle_epi32(prod_m, 0x4e));
            sm = _mm_add_epi32(sm, _mm_shuffle_epi32(sm, 0xb1));
            acc = fmaf((float)hsum_v8(total), d, acc);
            accm = fmaf((float)_mm_cvtsi128_si32(sm), dmin, accm);
        }
    }
    return acc - accm;
}

/* The four int32 sums of four vectors of eight: [sum(t0), sum(t1), sum(t2), sum(t3)] (exact: integer adds). */
static inline __m128i hsum4_v8(__m256i t0, __m256i t1, __m256i t2, __m256i t3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(t0, t1), _mm256_hadd_epi32(t2, t3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static inline __m128i hsum4_v4(__m128i t0, __m128i t1, __m128i t2, __m128i t3) {
    return _mm_hadd_epi32(_mm_hadd_epi32(t0, t1), _mm_hadd_epi32(t2, t3));
}

static inline void load_q8k_block(const act_q8k *x, __m256i xq[8]) {
    for (int v = 0; v < 8; v++) xq[v] = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * v));
}

/* One Q4_K super-block's weights as dot_q4k_direct multiplies them, unpacked once for any number of activation rows:
 * the low and high nibbles of each 32-byte run (q[2c], q[2c + 1]), their eight scales broadcast, the eight mins
 * widened, d and dmin. */
typedef struct {
    __m256i q[8], scale[8];
    __m128i mins;
    float d, dmin;
} q4k_block;

static inline void q4k_unpack(const uint8_t *blk, q4k_block *u) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256i sc16;
    q4k_header(blk, &u->d, &u->dmin, &sc16, &u->mins);
    for (int v = 0; v < 8; v++) u->scale[v] = scale_k(sc16, v);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
        u->q[2 * c] = _mm256_and_si256(v, m4);
        u->q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
}

/* dot_q4k_direct of four weight rows (row stride rb) against m <= 4 activation rows (x, x + nb, ..), activation row i
 * by kind[i], where a row is of kind 1 (a sequence of 4 to 7 rows; rows all of kind 0 take the streamed
 * dot_q4k_rows_x4): out[4 i + r] is weight row r against activation row i, its
 * integer sums and float steps dot_q4k_direct's (lane r of the float vectors being weight row r's accumulator).
 * Each weight block is unpacked once for the m rows, each activation block loaded once for the four weight rows. */
static inline __attribute__((always_inline)) void dot_q4k_direct_x4(const uint8_t *src, int64_t rb, const act_q8k *x,
                                                                   int64_t nb, int m, const int *kind, float *out) {
    const int64_t ahead = x4_ahead(144, nb);
    __m128 acc[4], accm[4];
    for (int i = 0; i < m; i++) acc[i] = accm[i] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i total[4][4], part[4][4][4]; /* [activation row][weight row](, [64-value part]) */
        __m128i prod_m[4][4];
        float dw[4], dm[4];
        for (int r = 0; r < 4; r++) { /* a weight row's block unpacked, then taken by every activation row */
            const uint8_t *blk = src + r * rb + 144 * b;
            prefetch_x4(blk, 144, ahead, b, nb, rb);
            q4k_block u;
            q4k_unpack(blk, &u);
            dw[r] = u.d;
            dm[r] = u.dmin;
            for (int i = 0; i < m; i++) {
                const act_q8k *xb = &x[i * nb + b];
                const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)xb->bsums), _mm_loadu_si128((const __m128i *)(xb->bsums + 8)));
                prod_m[i][r] = _mm_madd_epi16(u.mins, bs);
                total[i][r] = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    const __m256i lo = _mm256_maddubs_epi16(u.q[2 * c], _mm256_loadu_si256((const __m256i *)(xb->qs + 64 * c)));
                    const __m256i hi = _mm256_maddubs_epi16(u.q[2 * c + 1], _mm256_loadu_si256((const __m256i *)(xb->qs + 64 * c + 32)));
                    part[i][r][c] = _mm256_add_epi32(_mm256_madd_epi16(lo, u.scale[2 * c]), _mm256_madd_epi16(hi, u.scale[2 * c + 1]));
                    total[i][r] = _mm256_add_epi32(total[i][r], part[i][r][c]);
                }
            }
        }
        const __m128 dw4 = _mm_loadu_ps(dw), dm4 = _mm_loadu_ps(dm);
        for (int i = 0; i < m; i++) {
            const __m128 xd = _mm_set1_ps(x[i * nb + b].d);
            const __m128 d = _mm_mul_ps(dw4, xd), dmin = _mm_mul_ps(dm4, xd);
            if (kind[i] == 1) { /* per 64 values, c = 0..3 in order: row r's sumi[c] and summ[c] in lane r */
                __m128 si[4], sm[4];
                for (int r = 0; r < 4; r++) {
                    si[r] = _mm_castsi128_ps(hsum4_v8(part[i][r][0], part[i][r][1], part[i][r][2], part[i][r][3]));
                    sm[r] = _mm_castsi128_ps(prod_m[i][r]);
                }
                _MM_TRANSPOSE4_PS(si[0], si[1], si[2], si[3]);
                _MM_TRANSPOSE4_PS(sm[0], sm[1], sm[2], sm[3]);
                for (int c = 0; c < 4; c++) {
                    acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_castps_si128(si[c])), d, acc[i]);
                    accm[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_castps_si128(sm[c])), dmin, accm[i]);
                }
            } else {
                const __m128i si = hsum4_v8(total[i][0], total[i][1], total[i][2], total[i][3]);
                const __m128i sm = hsum4_v4(prod_m[i][0], prod_m[i][1], prod_m[i][2], prod_m[i][3]);
                acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(si), d, acc[i]);
                accm[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(sm), dmin, accm[i]);
            }
        }
    }
    for (int i = 0; i < m; i++) _mm_storeu_ps(out + 4 * i, _mm_sub_ps(acc[i], accm[i]));
}

/* dot_q4k_direct of four weight rows (row stride rb) against m = 1..4 activation rows, all of kind 0 (a decode, a
 * verification's rows, continuous batching's sequences): out[4 i + r] is weight row r against activation row i. Each
 * 64-value part of a weight row's block is unpacked once and multiplied by the m rows as it is, so a part's two vectors
 * and two scales are live where the general form (dot_q4k_direct_x4) holds the block's 16 and spills on AVX2. The
 * integer sums and float steps of each activation row are dot_q4k_direct's (kind 0), lane r a weight row's. */
static inline __attribute__((always_inline)) void dot_q4k_rows_x4(const uint8_t *src, int64_t rb, const act_q8k *x, int64_t nb,
                                                                 const int m, float *out) {
    const int64_t ahead = x4_ahead(144, nb);
    const __m256i m4 = _mm256_set1_epi8(15);
    __m128 acc[4], accm[4];
    for (int i = 0; i < m; i++) acc[i] = accm[i] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m128i bs[4], prod_m[4][4];
        __m256i total[4][4];
        float dw[4], dm[4];
        for (int i = 0; i < m; i++) {
            const act_q8k *xb = &x[i * nb + b];
            bs[i] = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)xb->bsums), _mm_loadu_si128((const __m128i *)(xb->bsums + 8)));
        }
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = src + r * rb + 144 * b, *qs = blk + 16;
            prefetch_x4(blk, 144, ahead, b, nb, rb);
            __m256i sc16;
            __m128i mins;
            q4k_header(blk, &dw[r], &dm[r], &sc16, &mins);
            __m256i t[4];
            for (int i = 0; i < m; i++) {
                prod_m[i][r] = _mm_madd_epi16(mins, bs[i]);
                t[i] = _mm256_setzero_si256();
            }
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                const __m256i s_lo = scale_k(sc16, 2 * c), s_hi = scale_k(sc16, 2 * c + 1);
                for (int i = 0; i < m; i++) {
                    const int8_t *xq = x[i * nb + b].qs + 64 * c;
                    const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)), s_lo);
                    const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))), s_hi);
                    t[i] = _mm256_add_epi32(t[i], _mm256_add_epi32(plo, phi));
                }
            }
            for (int i = 0; i < m; i++) total[i][r] = t[i];
        }
        const __m128 dw4 = _mm_loadu_ps(dw), dm4 = _mm_loadu_ps(dm);
        for (int i = 0; i < m; i++) {
            const __m128 xd = _mm_set1_ps(x[i * nb + b].d);
            const __m128i si = hsum4_v8(total[i][0], total[i][1], total[i][2], total[i][3]);
            const __m128i sm = hsum4_v4(prod_m[i][0], prod_m[i][1], prod_m[i][2], prod_m[i][3]);
            acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(si), _mm_mul_ps(dw4, xd), acc[i]);
            accm[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(sm), _mm_mul_ps(dm4, xd), accm[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm_storeu_ps(out + 4 * i, _mm_sub_ps(acc[i], accm[i]));
}

/* One Q6_K super-block's weights as its lanes multiply them, unpacked once for any number of activation rows: the 8
 * vectors of 32 6-bit values (0..63) and each vector's two 16-value scales, broadcast to its halves. */
typedef struct {
    __m256i q[8], scale[8], scales16;
} q6k_block;

/* Vector v's two 16-value scales (signed bytes 2v and 2v + 1 of s8), widened to the low and high half's 16-bit
 * lanes: one byte shuffle and one widening, where two set1s from memory and an insert took seven instructions. */
static inline __m256i scale_k6(__m128i s8, int v) {
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, _mm_set_epi64x(0x0101010101010101LL * (2 * v + 1), 0x0101010101010101LL * (2 * v))));
}

/* Half n (0, 1) of a Q6_K super-block: its four vectors of 32 6-bit values (0..63), vectors 4n..4n+3 of the block. */
static inline void q6k_half(const blk_q6_K *w, int n, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(w->qh + 32 * n));
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * n));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * n + 32));
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
}

static inline void q6k_unpack(const blk_q6_K *w, q6k_block *u) {
    for (int n = 0; n < 2; n++) q6k_half(w, n, u->q + 4 * n);
    const __m128i s8 = _mm_loadu_si128((const __m128i *)w->scales);
    for (int v = 0; v < 8; v++) u->scale[v] = scale_k6(s8, v);
    u->scales16 = _mm256_cvtepi8_epi16(s8);
}

/* The eight int32 lanes of an unpacked Q6_K super-block against its activation block (xq: the 8 vectors of 32
 * quants): lane l = sum over the 8 vectors of scale * (bytes 4l..4l+3 dot) - 32 (sc[2l] bsum[2l] + sc[2l+1]
 * bsum[2l+1]). */
static inline __m256i q6k_lanes(const q6k_block *u, const __m256i xq[8], __m256i bsums) {
    __m256i sum = _mm256_setzero_si256();
    for (int v = 0; v < 8; v++) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u->q[v], xq[v]), u->scale[v]));
    return _mm256_sub_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(u->scales16, bsums), 5));
}

static inline __m256i q6k_block_lanes(const blk_q6_K *w, const __m256i xq[8], __m256i bsums) {
    q6k_block u;
    q6k_unpack(w, &u);
    return q6k_lanes(&u, xq, bsums);
}

/* dot_k6 from the block bytes: the same eight integer lanes as k6_lanes over the decoded row. */
static float dot_q6k_direct(const uint8_t *src, const act_q8k *x, int64_t nb, int tiled) {
    float acc[8], acc1 = 0.0f;
    __m256 vacc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q6_K *w = (const blk_q6_K *)(src + 210 * b);
        prefetch_lines((const uint8_t *)w + PREFETCH_AHEAD, 210);
        __m256i xq[8];
        load_q8k_block(&x[b], xq);
        const __m256i sum = q6k_block_lanes(w, xq, _mm256_loadu_si256((const __m256i *)x[b].bsums));
        const float wd = h2f(w->d);
        if (tiled) {
            acc1 = fmaf(wd * (float)hsum_v8(sum), x[b].d, acc1);
        } else {
            vacc = _mm256_fmadd_ps(_mm256_set1_ps(x[b].d * wd), _mm256_cvtepi32_ps(sum), vacc);
        }
    }
    _mm256_storeu_ps(acc, vacc);
    return tiled ? acc1 : hsum8(acc);
}

/* dot_q6k_direct (not tiled) of four weight rows (row stride rb) against m = 1..4 activation rows (a decode, a
 * verification, continuous batching): out[4 i + r] is weight row r against activation row i. Each 32-value vector of
 * a weight row's block is unpacked once, its scales shuffled in once, and multiplied by the m rows as it is (a block
 * unpacked whole first is 16 vectors, which spilled on AVX2's 16 registers). Lanes and float steps are
 * dot_q6k_direct's. */
static inline __attribute__((always_inline)) void dot_q6k_rows_x4(const uint8_t *src, int64_t rb, const act_q8k *x, int64_t nb,
                                                                 const int m, float *out) {
    const int64_t ahead = x4_ahead(210, nb);
    __m256 vacc[4][4];
    for (int i = 0; i < m; i++)
        for (int r = 0; r < 4; r++) vacc[i][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < 4; r++) {
            const blk_q6_K *w = (const blk_q6_K *)(src + r * rb + 210 * b);
            prefetch_x4((const uint8_t *)w, 210, ahead, b, nb, rb);
            const __m128i s8 = _mm_loadu_si128((const __m128i *)w->scales);
            __m256i sum[4];
            for (int i = 0; i < m; i++) sum[i] = _mm256_setzero_si256();
            for (int n = 0; n < 2; n++) {
                __m256i q[4];
                q6k_half(w, n, q);
                for (int j = 0; j < 4; j++) {
                    const int v = 4 * n + j;
                    const __m256i scale = scale_k6(s8, v);
                    for (int i = 0; i < m; i++) {
                        const __m256i xq = _mm256_loadu_si256((const __m256i *)(x[i * nb + b].qs + 32 * v));
                        sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], xq), scale));
                    }
                }
            }
            const __m256i scales16 = _mm256_cvtepi8_epi16(s8);
            const float wd = h2f(w->d);
            for (int i = 0; i < m; i++) {
                const act_q8k *xb = &x[i * nb + b];
                const __m256i bsums = _mm256_loadu_si256((const __m256i *)xb->bsums);
                const __m256i lanes = _mm256_sub_epi32(sum[i], _mm256_slli_epi32(_mm256_madd_epi16(scales16, bsums), 5));
                vacc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(xb->d * wd), _mm256_cvtepi32_ps(lanes), vacc[i][r]);
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < 4; r++) {
            float acc[8];
            _mm256_storeu_ps(acc, vacc[i][r]);
            out[4 * i + r] = hsum8(acc);
        }
}

#endif

/* ---- tiled GEMM for batches of 8+ rows (AVX2, AVX-512 VNNI) ------------------------------------------- */
/*
 * GEMM_LW weight rows are repacked into a tile whose vectors hold 4 weight bytes of each row (row r in int32
 * lane r), so one dp4 (a vpdpbusd, or maddubs + madd) takes a 4-byte group of every row against 4 activation
 * bytes broadcast: every lane of every vector is one output, and the float steps of each output are those of
 * the row path, lane for lane. A tile is decoded once and multiplied by all m activation rows, RN at a time.
 */
#ifdef MTP_AVX2
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GEMM_LW 16
#define GEMM_VNNI 1
typedef __m512i gv_i;
typedef __m512 gv_f;
static inline gv_i gi_zero(void) { return _mm512_setzero_si512(); }
static inline gv_i gi_load(const void *p) { return _mm512_load_si512(p); }
static inline gv_i gi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline gv_i gi_add(gv_i a, gv_i b) { return _mm512_add_epi32(a, b); }
static inline gv_i gi_mullo(gv_i a, gv_i b) { return _mm512_mullo_epi32(a, b); }
static inline gv_i gi_madd16(gv_i a, gv_i b) { return _mm512_madd_epi16(a, b); }
/* lane += sum of the 4 products of unsigned bytes u and signed bytes s (exact: no saturation) */
static inline gv_i gi_dp4(gv_i acc, gv_i u, gv_i s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline gv_f gf_zero(void) { return _mm512_setzero_ps(); }
static inline gv_f gf_load(const float *p) { return _mm512_load_ps(p); }
static inline gv_f gf_set1(float v) { return _mm512_set1_ps(v); }
static inline gv_f gf_add(gv_f a, gv_f b) { return _mm512_add_ps(a, b); }
static inline gv_f gf_sub(gv_f a, gv_f b) { return _mm512_sub_ps(a, b); }
static inline gv_f gf_mul(gv_f a, gv_f b) { return _mm512_mul_ps(a, b); }
static inline gv_f gf_fma(gv_f a, gv_f b, gv_f c) { return _mm512_fmadd_ps(a, b, c); }
static inline gv_f gf_fnma(gv_f a, gv_f b, gv_f c) { return _mm512_fnmadd_ps(a, b, c); }
static inline gv_f gf_cvt(gv_i v) { return _mm512_cvtepi32_ps(v); }
static inline void gf_store_n(float *p, gv_f v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
#else
#define GEMM_LW 8
typedef __m256i gv_i;
typedef __m256 gv_f;
static inline gv_i gi_zero(void) { return _mm256_setzero_si256(); }
static inline gv_i gi_load(const void *p) { return _mm256_load_si256(p); }
static inline gv_i gi_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline gv_i gi_add(gv_i a, gv_i b) { return _mm256_add_epi32(a, b); }
static inline gv_i gi_mullo(gv_i a, gv_i b) { return _mm256_mullo_epi32(a, b); }
static inline gv_i gi_madd16(gv_i a, gv_i b) { return _mm256_madd_epi16(a, b); }
/* exact while no pair of products passes 32767: u <= 128 against |s| <= 127, or u <= 63 */
static inline gv_i gi_dp4(gv_i acc, gv_i u, gv_i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline gv_f gf_zero(void) { return _mm256_setzero_ps(); }
static inline gv_f gf_load(const float *p) { return _mm256_load_ps(p); }
static inline gv_f gf_set1(float v) { return _mm256_set1_ps(v); }
static inline gv_f gf_add(gv_f a, gv_f b) { return _mm256_add_ps(a, b); }
static inline gv_f gf_sub(gv_f a, gv_f b) { return _mm256_sub_ps(a, b); }
static inline gv_f gf_mul(gv_f a, gv_f b) { return _mm256_mul_ps(a, b); }
static inline gv_f gf_fma(gv_f a, gv_f b, gv_f c) { return _mm256_fmadd_ps(a, b, c); }
static inline gv_f gf_fnma(gv_f a, gv_f b, gv_f c) { return _mm256_fnmadd_ps(a, b, c); }
static inline gv_f gf_cvt(gv_i v) { return _mm256_cvtepi32_ps(v); }
static inline void gf_store_n(float *p, gv_f v, int n) {
    if (n == 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v);
}
#endif

#define GEMM_INLINE static inline __attribute__((always_inline))

static inline int32_t ld32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ((0+4)+(2+6)) + ((1+5)+(3+7)) over eight accumulators: hsum8 of every lane at once */
static inline gv_f gf_hsum8(const gv_f a[8]) {
    const gv_f r0 = gf_add(a[4], a[0]), r1 = gf_add(a[5], a[1]), r2 = gf_add(a[6], a[2]), r3 = gf_add(a[7], a[3]);
    return gf_add(gf_add(r0, r2), gf_add(r1, r3));
}

static inline int gemm_type(int type) {
    switch (type) {
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_Q4_K: case T_Q5_K: case T_Q6_K: return 1;
        default: return 0;
    }
}

/* Short sequences (seq_len < 8: decode, verification) go through the tiles where the tiles give their numbers bit
 * for bit and enough rows share a tile to pay for decoding it (several sequences decoding together, a
 * verification). Measured against the four-rows-a-pass GEMVs on tinyqwen35's matrices, one thread:
 *  - the 32-element types (one rule at every batch size): from 2 activation rows (Q5_0 256 x 128: 5.9 us against
 *    8.0 at 2 rows, 6.9 against 26 at 4);
 *  - Q4_K (kind 0 or 1 per row, as dot_q4k_direct): from 4 (256 x 768: 2 rows 20.4 us against 13.1, 4 rows 22.1
 *    against 26.4, 8 rows 27.5 against 50.8). Kept so when the GEMVs came to unpack each block once for up to four
 *    rows: at 4 rows the 27B's ffn_up reads 10.5 GB/s through them against 6.8-7.9 through the tiles, but
 *    tinyqwen35's matrices 4.1 against 5.1 (kept tiles), and at 5-6 rows the tiles tie or win. Where every row is
 *    of kind 0 (seq_len < 4: continuous batching's sequences of one), from 5, as Q6_K: the streamed rows form
 *    (dot_q4k_rows_x4) at 4 rows, 2 threads, read the 27B's ffn_up 10.3-11.0 GB/s against 6.5-6.9 through the tiles,
 *    Gemma 3's Q4_K matrices 7.7-8.3 against 4.7-5.3 (kept tiles), tinyqwen35's 3.5-3.7 against 2.4-3.8 (kept);
 *  - Q6_K (tile_k6_lanes: the eight lanes of the decode rule, not the GEMM rule's one sum): from 5, since the
 *    four-row GEMVs unpack each weight block once for up to four activation rows (dot_q6k_rows_x4). The 27B's
 *    ffn_down, 2 threads, GB/s at 2 / 3 / 4 / 5 rows: tiles 10.6 / 8.7 / 8.1 / 7.9 (kept), the GEMVs 26.6 / 24.0 /
 *    19.9 / 14.3; tinyqwen35's output, ffn_down and attn_qkv: tiles 18.2 / 14.4 / 13.6 / 12.7 (kept), the GEMVs
 *    18.3 / 16.1 / 14.3 / 11.5. (Before that sharing, 2 rows went to the tiles: the 4096 x 256 output 105 us
 *    against 118, 3 rows 122 against 152.)
 * Q5_K rounds a short sequence differently from its tiles' llama.cpp GEMM rule: row by row. Returns 0 where the
 * rows go row by row. */
static inline int short_tile_rows(int type, int64_t seq_len) {
    if (type == T_Q4_K) return seq_len < 4 ? 5 : 4; /* every row of kind 0 (streamed) : some of kind 1 */
    if (type == T_Q6_K) return 5;
    return gemm_type(type) && type != T_Q5_K ? 2 : 0;
}

static inline int tiles_take(int type, int64_t m, int64_t seq_len) {
    return seq_len >= 8 ? gemm_type(type) : short_tile_rows(type, seq_len) && m >= short_tile_rows(type, seq_len);
}

static inline int signed_type(int type) { return type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0; }

/* GEMM_LW decoded weight rows, lane r = row r: q holds one int32 of 4 weight bytes per lane for each 4-value
 * group (in the decoded element order), then per-block scalars. Signed types are stored + 128 (as unsigned
 * bytes) under VNNI; the activations' side arrays take the 128 back off. */
typedef struct {
    int32_t *q;  /* [k / 4][LW] */
    float *d, *m; /* [blocks][LW]: d and m (32-element types) or d and dmin (K-quants) */
    int32_t *sc; /* [sub-blocks][LW]: K-quant scales (8 per super-block, 16 for Q6_K) */
    int32_t *mn; /* [super-blocks][4][LW]: Q4_K/Q5_K mins of sub-blocks 2c and 2c + 1 as two int16 */
} wtile;

static __thread wtile scratch_tile;
static __thread wrow scratch_lanes[GEMM_LW]; /* the tile's rows, decoded */
static __thread int64_t scratch_tile_k;

/* n int32 / float vectors of GEMM_LW lanes, 64-byte aligned (aligned_alloc wants a multiple of 64 bytes) */
static void *alloc_lanes(int64_t n) { return aligned_alloc(64, ((size_t)n * GEMM_LW * 4 + 63) / 64 * 64); }

static int scratch_tile_reserve(int64_t k) {
    if (scratch_tile_k >= k) return 0;
    wtile *t = &scratch_tile;
    free(t->q);
    free(t->d);
    free(t->m);
    free(t->sc);
    free(t->mn);
    t->q = alloc_lanes(k / 4);
    t->d = alloc_lanes(k / 32);
    t->m = alloc_lanes(k / 32);
    t->sc = alloc_lanes(k / 16);
    t->mn = alloc_lanes(k / 64 + 1);
    int ok = t->q && t->d && t->m && t->sc && t->mn;
    for (int l = 0; l < GEMM_LW; l++) {
        wrow *r = &scratch_lanes[l];
        wrow_free(r);
        wrow_alloc(r, k);
        ok = ok && r->q && r->d && r->m && r->sc && r->mn;
    }
    scratch_tile_k = ok ? k : 0;
    return ok ? 0 : 1;
}

/* dst[j * stride + i] = src[i][j] ^ flip for an 8 x 8 block of int32 */
static inline void transpose8x8(const int32_t *const src[8], int32_t *dst, int64_t stride, uint32_t flip) {
    __m256i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)src[i]);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);     /* a0 b0 a1 b1 | a4 b4 a5 b5 */
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]); /* a2 b2 a3 b3 | a6 b6 a7 b7 */
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + 2 * h] = _mm256_unpacklo_epi64(t[i + h], t[i + 2 + h]);     /* a0 b0 c0 d0 | a4 b4 c4 d4 (h = 1: 2, 6) */
            u[i + 2 * h + 1] = _mm256_unpackhi_epi64(t[i + h], t[i + 2 + h]); /* a1 b1 c1 d1 | a5 b5 c5 d5 (h = 1: 3, 7) */
        }
    const __m256i f = _mm256_set1_epi32((int)flip);
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_si256((__m256i *)(dst + j * stride), _mm256_xor_si256(_mm256_permute2x128_si256(u[j], u[4 + j], 0x20), f));
        _mm256_storeu_si256((__m256i *)(dst + (j + 4) * stride), _mm256_xor_si256(_mm256_permute2x128_si256(u[j], u[4 + j], 0x31), f));
    }
}

/* Rows [0, nv) of src (rb bytes apart) into the tile; lanes nv.. repeat row 0 (computed, never stored). */
static void wtile_pack(int type, const uint8_t *src, int64_t rb, int nv, int64_t k, wtile *t) {
    const int64_t nb = k / row_block(type);
    const int kq = row_block(type) == 256, n_sc = type == T_Q6_K ? 16 : 8;
#ifdef GEMM_VNNI
    const uint32_t flip = signed_type(type) ? 0x80808080u : 0;
#else
    const uint32_t flip = 0;
#endif
    const wrow *lane[GEMM_LW];
    for (int l = 0; l < GEMM_LW; l++) {
        lane[l] = l < nv ? &scratch_lanes[l] : &scratch_lanes[0];
        if (l < nv) decode_row(type, src + l * rb, k, &scratch_lanes[l]);
    }
    for (int h = 0; h < GEMM_LW; h += 8)
        for (int64_t g = 0; g < k / 4; g += 8) {
            const int32_t *rows[8];
            for (int i = 0; i < 8; i++) rows[i] = (const int32_t *)lane[h + i]->q + g;
            transpose8x8(rows, t->q + g * GEMM_LW + h, GEMM_LW, flip);
        }
    for (int64_t b = 0; b < nb; b++)
        for (int l = 0; l < GEMM_LW; l++) {
            t->d[b * GEMM_LW + l] = lane[l]->d[b];
            t->m[b * GEMM_LW + l] = type == T_Q6_K ? 0.0f : lane[l]->m[b];
        }
    if (!kq) return;
    for (int64_t s = 0; s < nb * n_sc; s++)
        for (int l = 0; l < GEMM_LW; l++) t->sc[s * GEMM_LW + l] = lane[l]->sc[s];
    if (type != T_Q6_K)
        for (int64_t s = 0; s < nb * 4; s++)
            for (int l = 0; l < GEMM_LW; l++)
                t->mn[s * GEMM_LW + l] = (int32_t)((uint32_t)(uint16_t)lane[l]->mn[2 * s] | (uint32_t)lane[l]->mn[2 * s + 1] << 16);
}

/* ---- packed tiles kept between calls (llama.cpp's --repack) ------------------------------------------------- */
/* A short-sequence batch (several sequences decoding together, a verification) spends most of its time packing
 * tiles that it then uses for 2-7 activation rows. A matrix registered here (mtp_tiles_register, by the Python
 * side for every matrix it loads onto the CPU, forgotten when its bytes go) has its tiles packed on its first tiled
 * call and kept, while the kept bytes stay under the limit (mtp_tiles_limit); past it, a matrix's tiles are packed
 * per call as before. The kept tiles are the bytes wtile_pack makes for that tile, so no result changes. */
typedef struct tile_entry {
    struct tile_entry *next;
    const uint8_t *W;
    int type;
    int64_t rows, k;
    int refs;
    int state; /* TILES_* (under tile_lock) */
    wtile *tiles; /* tile t: rows t LW .. t LW + LW - 1 (past the end: row t LW again, never stored) */
    void *mem;
    size_t bytes;
} tile_entry;

enum { TILES_UNPACKED = 0, TILES_PACKING = 1, TILES_PACKED = 2, TILES_REFUSED = 3 };
#define TILE_BUCKETS 4096
static tile_entry *tile_buckets[TILE_BUCKETS];
static pthread_mutex_t tile_lock = PTHREAD_MUTEX_INITIALIZER;
static size_t tile_kept_bytes, tile_limit = (size_t)1 << 30; /* 1 GiB unless told otherwise */

static inline size_t tile_bucket(const uint8_t *W) { return (size_t)(((uintptr_t)W >> 4) * 0x9E3779B97F4A7C15ull >> 52); }
static inline size_t pad64(size_t n) { return (n + 63) / 64 * 64; }

/* Bytes of one kept tile's arrays (each 64-byte aligned): q, d, m, then the K-quants' scales and Q4_K/Q5_K's mins. */
static size_t tile_arrays(int type, int64_t k, size_t sizes[5]) {
    const int64_t nb = k / row_block(type);
    const int kq = row_block(type) == 256, n_sc = type == T_Q6_K ? 16 : 8;
    sizes[0] = pad64((size_t)(k / 4) * GEMM_LW * 4);
    sizes[1] = sizes[2] = pad64((size_t)nb * GEMM_LW * 4);
    sizes[3] = kq ? pad64((size_t)(nb * n_sc) * GEMM_LW * 4) : 0;
    sizes[4] = type == T_Q4_K || type == T_Q5_K ? pad64((size_t)(nb * 4) * GEMM_LW * 4) : 0;
    return sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4];
}

/* The link to the entry registered for exactly this matrix (*link NULL where there is none); under tile_lock. */
static tile_entry **entry_link(const uint8_t *W, int type, int64_t rows, int64_t k) {
    tile_entry **link = &tile_buckets[tile_bucket(W)];
    while (*link && !((*link)->W == W && (*link)->type == type && (*link)->rows == rows && (*link)->k == k))
        link = &(*link)->next;
    return link;
}

int mtp_tiles_register(const uint8_t *W, int type, int64_t rows, int64_t k) {
    if (!gemm_type(type) || rows <= 0 || k <= 0 || k % row_block(type)) return 0;
    pthread_mutex_lock(&tile_lock);
    tile_entry **link = entry_link(W, type, rows, k), *e = *link;
    if (!e && (e = calloc(1, sizeof(*e)))) {
        *e = (tile_entry){NULL, W, type, rows, k, 0, TILES_UNPACKED, NULL, NULL, 0};
        *link = e; /* the end of its bucket's chain */
    }
    if (e) e->refs++;
    pthread_mutex_unlock(&tile_lock);
    return e != NULL;
}

void mtp_tiles_forget(const uint8_t *W, int type, int64_t rows, int64_t k) {
    pthread_mutex_lock(&tile_lock);
    tile_entry **link = entry_link(W, type, rows, k), *e = *link;
    if (e && --e->refs == 0) {
        *link = e->next;
        if (e->state == TILES_PACKED) tile_kept_bytes -= e->bytes;
        free(e->mem);
        free(e->tiles);
        free(e);
    }
    pthread_mutex_unlock(&tile_lock);
}

/* Sets the limit on kept bytes, for matrices packed from now on (tiles already kept stay until their matrix goes;
 * matrices refused under the old limit may be packed under the new); returns the previous limit. */
size_t mtp_tiles_limit(size_t bytes) {
    pthread_mutex_lock(&tile_lock);
    const size_t previous = tile_limit;
    tile_limit = bytes;
    for (int b = 0; b < TILE_BUCKETS; b++)
        for (tile_entry *e = tile_buckets[b]; e; e = e->next)
            if (e->state == TILES_REFUSED) e->state = TILES_UNPACKED;
    pthread_mutex_unlock(&tile_lock);
    return previous;
}

/* The limit on kept bytes now (without setting it: the memory plan reads it). */
size_t mtp_tiles_limit_now(void) {
    pthread_mutex_lock(&tile_lock);
    const size_t n = tile_limit;
    pthread_mutex_unlock(&tile_lock);
    return n;
}

size_t mtp_tiles_kept_bytes(void) {
    pthread_mutex_lock(&tile_lock);
    const size_t n = tile_kept_bytes;
    pthread_mutex_unlock(&tile_lock);
    return n;
}

typedef struct { const tile_entry *e; _Atomic int failed; } pack_job;

static void pack_tiles(void *ctx, int64_t begin, int64_t end) {
    pack_job *j = ctx;
    const tile_entry *e = j->e;
    if (scratch_tile_reserve(e->k)) {
        j->failed = 1;
        return;
    }
    const int64_t rb = row_bytes(e->type, e->k);
    for (int64_t t = begin; t < end; t++) {
        const int64_t n0 = t * GEMM_LW, nv = e->rows - n0 < GEMM_LW ? e->rows - n0 : GEMM_LW;
        wtile_pack(e->type, e->W + n0 * rb, rb, (int)nv, e->k, &e->tiles[t]);
    }
}

/* The kept tiles of W (a matrix of at least `rows` rows), packed now if this is its first tiled call and the limit
 * allows; NULL where it is not registered, refused, or being packed by another caller. */
static const wtile *kept_tiles(const uint8_t *W, int type, int64_t rows, int64_t k, int n_threads) {
    pthread_mutex_lock(&tile_lock);
    tile_entry *e = tile_buckets[tile_bucket(W)];
    while (e && !(e->W == W && e->type == type && e->rows >= rows && e->k == k)) e = e->next;
    size_t sizes[5], per_tile = 0, bytes = 0;
    int64_t n_tiles = 0;
    if (e && e->state == TILES_UNPACKED) {
        per_tile = tile_arrays(type, k, sizes);
        n_tiles = (e->rows + GEMM_LW - 1) / GEMM_LW;
        bytes = per_tile * (size_t)n_tiles;
        e->state = tile_kept_bytes + bytes <= tile_limit ? TILES_PACKING : TILES_REFUSED;
        if (e->state == TILES_PACKING) tile_kept_bytes += bytes;
    }
    const int pack = e && e->state == TILES_PACKING && bytes;
    const wtile *kept = e && e->state == TILES_PACKED ? e->tiles : NULL;
    pthread_mutex_unlock(&tile_lock);
    if (!pack) return kept;
    uint8_t *mem = aligned_alloc(64, bytes);
    wtile *tiles = calloc((size_t)n_tiles, sizeof(wtile));
    pack_job job = {e, 0};
    if (mem && tiles) {
        for (int64_t t = 0; t < n_tiles; t++) {
            uint8_t *p = mem + (size_t)t * per_tile;
            tiles[t] = (wtile){(int32_t *)p, (float *)(p + sizes[0]), (float *)(p + sizes[0] + sizes[1]),
                               sizes[3] ? (int32_t *)(p + sizes[0] + sizes[1] + sizes[2]) : NULL,
                               sizes[4] ? (int32_t *)(p + sizes[0] + sizes[1] + sizes[2] + sizes[3]) : NULL};
        }
        e->tiles = tiles;
        mtp_parallel_for(n_tiles, chunk_grain(n_tiles, n_threads, 4, 1), n_threads, pack_tiles, &job);
    }
    const int ok = mem && tiles && !job.failed;
    pthread_mutex_lock(&tile_lock);
    if (ok) {
        e->mem = mem;
        e->bytes = bytes;
        e->state = TILES_PACKED;
    } else {
        free(mem);
        free(tiles);
        e->tiles = NULL;
        tile_kept_bytes -= bytes;
        e->state = TILES_REFUSED;
    }
    pthread_mutex_unlock(&tile_lock);
    return ok ? tiles : NULL;
}

/* Activation side arrays, one set per row: what the tiles need beyond act_q8 / act_q8k. */
typedef struct { int32_t bsp[4]; int32_t nbs32[16]; } act_kside; /* per super-block */

/* bsp[c]: bsums 4c + 4c+1 and 4c+2 + 4c+3 as two int16 (for the mins); nbs32[j] = -32 bsums[j] (Q6_K's offset) */
static void kside_row(const act_q8k *x, int64_t nb, act_kside *o) {
    for (int64_t b = 0; b < nb; b++) {
        const int16_t *bs = x[b].bsums;
        for (int c = 0; c < 4; c++) {
            const uint32_t lo = (uint16_t)(bs[4 * c] + bs[4 * c + 1]), hi = (uint16_t)(bs[4 * c + 2] + bs[4 * c + 3]);
            o[b].bsp[c] = (int32_t)(lo | hi << 16);
        }
        for (int j = 0; j < 16; j++) o[b].nbs32[j] = -32 * bs[j];
    }
}

/* -128 * (sum of each 4 activation bytes): takes off the + 128 of signed weights stored unsigned (VNNI) */
static void xcorr_row(const act_q8 *x, int64_t nb, int32_t *o) {
    for (int64_t b = 0; b < nb; b++)
        for (int l = 0; l < 8; l++) {
            const int8_t *q = x[b].qs + 4 * l;
            o[8 * b + l] = -128 * (q[0] + q[1] + q[2] + q[3]);
        }
}

/* Registers: RN activation rows per pass, so that accumulators, scales and a weight vector fit in 32 (16). */
#define RN32 (GEMM_LW == 16 ? 2 : 1)
#define RNK4 (GEMM_LW == 16 ? 4 : 2)
#define RNK6 (GEMM_LW == 16 ? 6 : 2)
_Static_assert(RN32 <= 6 && RNK4 <= 6 && RNK6 <= 6, "RN_CASES dispatches rn = 1..6");

/* 32-element types: acc[i][l] = fma(d_w d_x, lane l, acc[i][l]) per block, hsum8 + (Q4_1/Q5_1) the m s sum. */
GEMM_INLINE void tile32(const wtile *t, const act_q8 *x, const int32_t *xc, int64_t nb, const int rn, const int sgn,
                        const int has_min, float *y, int64_t ldy, int nv) {
    gv_f acc[RN32][8], summs[RN32];
    for (int i = 0; i < rn; i++) {
        summs[i] = gf_zero();
        for (int l = 0; l < 8; l++) acc[i][l] = gf_zero();
    }
    for (int64_t b = 0; b < nb; b++) {
        const gv_f dw = gf_load(t->d + b * GEMM_LW);
        gv_f s[RN32];
        for (int i = 0; i < rn; i++) s[i] = gf_mul(dw, gf_set1(x[i * nb + b].d));
        for (int l = 0; l < 8; l++) {
            const gv_i w = gi_load(t->q + (8 * b + l) * GEMM_LW);
#ifndef GEMM_VNNI
            const gv_i wabs = _mm256_abs_epi8(w); /* sign trick: |w| against x signed as w */
            (void)xc;
#endif
            for (int i = 0; i < rn; i++) {
                const gv_i xv = gi_set1(ld32(x[i * nb + b].qs + 4 * l));
                gv_i v;
                if (!sgn) v = gi_dp4(gi_zero(), w, xv);
#ifdef GEMM_VNNI
                else v = gi_dp4(gi_set1(xc[(i * nb + b) * 8 + l]), w, xv);
#else
                else v = gi_dp4(gi_zero(), wabs, _mm256_sign_epi8(xv, w));
#endif
                acc[i][l] = gf_fma(s[i], gf_cvt(v), acc[i][l]);
            }
        }
        if (has_min) {
            const gv_f m = gf_load(t->m + b * GEMM_LW);
            for (int i = 0; i < rn; i++) summs[i] = gf_fma(m, gf_set1(x[i * nb + b].s), summs[i]);
        }
    }
    for (int i = 0; i < rn; i++) gf_store_n(y + i * ldy, gf_add(gf_hsum8(acc[i]), summs[i]), nv);
}

/* Q4_K (kind 1: a float step per 64 values; kind 0: per super-block) and Q5_K (kind 2), as dot_k4. */
GEMM_INLINE void tile_k4(const wtile *t, const act_q8k *x, const act_kside *ks, int64_t nb, const int rn, const int q5,
                         const uint8_t *kind1, float *y, int64_t ldy, int nv) {
    gv_f acc[RNK4], accm[RNK4];
    for (int i = 0; i < rn; i++) acc[i] = accm[i] = gf_zero();
    for (int64_t b = 0; b < nb; b++) {
        gv_i si[RNK4], sm[RNK4];
        for (int i = 0; i < rn; i++) si[i] = sm[i] = gi_zero();
        for (int c = 0; c < 4; c++) {
            gv_i lo[RNK4], hi[RNK4];
            for (int i = 0; i < rn; i++) lo[i] = hi[i] = gi_zero();
            for (int l = 0; l < 8; l++) {
                const gv_i w0 = gi_load(t->q + (64 * b + 16 * c + l) * GEMM_LW);
                const gv_i w1 = gi_load(t->q + (64 * b + 16 * c + 8 + l) * GEMM_LW);
                for (int i = 0; i < rn; i++) {
                    const int8_t *xq = x[i * nb + b].qs + 64 * c + 4 * l;
                    lo[i] = gi_dp4(lo[i], w0, gi_set1(ld32(xq)));
                    hi[i] = gi_dp4(hi[i], w1, gi_set1(ld32(xq + 32)));
                }
            }
            const gv_i sc0 = gi_load(t->sc + (8 * b + 2 * c) * GEMM_LW), sc1 = gi_load(t->sc + (8 * b + 2 * c + 1) * GEMM_LW);
            const gv_i mn = gi_load(t->mn + (4 * b + c) * GEMM_LW);
            for (int i = 0; i < rn; i++) {
                const gv_i sumi = gi_add(gi_mullo(lo[i], sc0), gi_mullo(hi[i], sc1));
                const gv_i summ = gi_madd16(mn, gi_set1(ks[i * nb + b].bsp[c]));
                if (!q5 && kind1[i]) {
                    const float dx = x[i * nb + b].d;
                    acc[i] = gf_fma(gf_cvt(sumi), gf_mul(gf_load(t->d + b * GEMM_LW), gf_set1(dx)), acc[i]);
                    accm[i] = gf_fma(gf_cvt(summ), gf_mul(gf_load(t->m + b * GEMM_LW), gf_set1(dx)), accm[i]);
                } else {
                    si[i] = gi_add(si[i], sumi);
                    sm[i] = gi_add(sm[i], summ);
                }
            }
        }
        const gv_f dw = gf_load(t->d + b * GEMM_LW), dmw = gf_load(t->m + b * GEMM_LW);
        for (int i = 0; i < rn; i++) {
            const gv_f dx = gf_set1(x[i * nb + b].d);
            if (q5) acc[i] = gf_fma(gf_fnma(dmw, gf_cvt(sm[i]), gf_mul(dw, gf_cvt(si[i]))), dx, acc[i]);
            else if (!kind1[i]) {
                acc[i] = gf_fma(gf_cvt(si[i]), gf_mul(dw, dx), acc[i]);
                accm[i] = gf_fma(gf_cvt(sm[i]), gf_mul(dmw, dx), accm[i]);
            }
        }
    }
    for (int i = 0; i < rn; i++) gf_store_n(y + i * ldy, gf_sub(acc[i], accm[i]), nv);
}

/* Q6_K as dot_k6 tiled: per super-block T = sum_j sc_j (dot16_j - 32 bsum_j), acc = fma(d_w T, d_x, acc). */
GEMM_INLINE void tile_k6(const wtile *t, const act_q8k *x, const act_kside *ks, int64_t nb, const int rn, float *y,
                         int64_t ldy, int nv) {
    gv_f acc[RNK6];
    for (int i = 0; i < rn; i++) acc[i] = gf_zero();
    for (int64_t b = 0; b < nb; b++) {
        gv_i tot[RNK6];
        for (int i = 0; i < rn; i++) tot[i] = gi_zero();
        for (int j = 0; j < 16; j++) {
            gv_i v[RNK6];
            for (int i = 0; i < rn; i++) v[i] = gi_set1(ks[i * nb + b].nbs32[j]);
            for (int l = 0; l < 4; l++) {
                const gv_i w = gi_load(t->q + (64 * b + 4 * j + l) * GEMM_LW);
                for (int i = 0; i < rn; i++) v[i] = gi_dp4(v[i], w, gi_set1(ld32(x[i * nb + b].qs + 16 * j + 4 * l)));
            }
            const gv_i sc = gi_load(t->sc + (16 * b + j) * GEMM_LW);
            for (int i = 0; i < rn; i++) tot[i] = gi_add(tot[i], gi_mullo(v[i], sc));
        }
        const gv_f dw = gf_load(t->d + b * GEMM_LW);
        for (int i = 0; i < rn; i++) acc[i] = gf_fma(gf_mul(dw, gf_cvt(tot[i])), gf_set1(x[i * nb + b].d), acc[i]);
    }
    for (int i = 0; i < rn; i++) gf_store_n(y + i * ldy, acc[i], nv);
}

/* Q6_K as dot_k6 not tiled (short sequences' rule, dot_q6k_direct): per super-block eight integer lanes a row, lane L
 * = sum over the 8 vectors of 32 values of sc[2v + L / 4] (dot of values 32v + 4L..+3) - 32 (sc[2L] bsum[2L] +
 * sc[2L+1] bsum[2L+1]), each into its own float accumulator, acc[L] = fma(d_x d_w, lane L, acc[L]), hsum8 at the end. */
#define RNK6L (GEMM_LW == 16 ? 2 : 1)
GEMM_INLINE void tile_k6_lanes(const wtile *t, const act_q8k *x, const act_kside *ks, int64_t nb, const int rn, float *y,
                               int64_t ldy, int nv) {
    gv_f acc[RNK6L][8];
    for (int i = 0; i < rn; i++)
        for (int l = 0; l < 8; l++) acc[i][l] = gf_zero();
    for (int64_t b = 0; b < nb; b++) {
        const gv_f dw = gf_load(t->d + b * GEMM_LW);
        for (int l = 0; l < 8; l++) {
            const gv_i sc0 = gi_load(t->sc + (16 * b + 2 * l) * GEMM_LW), sc1 = gi_load(t->sc + (16 * b + 2 * l + 1) * GEMM_LW);
            gv_i v[RNK6L];
            for (int i = 0; i < rn; i++) /* the lane's share of the offset, as llama.cpp's AVX2 kernel lays it out */
                v[i] = gi_add(gi_mullo(gi_set1(ks[i * nb + b].nbs32[2 * l]), sc0), gi_mullo(gi_set1(ks[i * nb + b].nbs32[2 * l + 1]), sc1));
            for (int vv = 0; vv < 8; vv++) {
                const int g = 8 * vv + l; /* values 4g..4g+3 of the super-block, scale 2 vv + l / 4 */
                const gv_i w = gi_load(t->q + (64 * b + g) * GEMM_LW), sc = gi_load(t->sc + (16 * b + 2 * vv + l / 4) * GEMM_LW);
                for (int i = 0; i < rn; i++)
                    v[i] = gi_add(v[i], gi_mullo(gi_dp4(gi_zero(), w, gi_set1(ld32(x[i * nb + b].qs + 4 * g))), sc));
            }
            for (int i = 0; i < rn; i++) acc[i][l] = gf_fma(gf_mul(gf_set1(x[i * nb + b].d), dw), gf_cvt(v[i]), acc[i][l]);
        }
    }
    for (int i = 0; i < rn; i++) gf_store_n(y + i * ldy, gf_hsum8(acc[i]), nv);
}

/* case n: the kernel call with rn = n as a constant (clamped to max so that unused cases still compile) */
#define RN_CASES(max, CALL)                         \
    case 1: CALL(1); break;                         \
    case 2: CALL((max) >= 2 ? 2 : 1); break;        \
    case 3: CALL((max) >= 3 ? 3 : 1); break;        \
    case 4: CALL((max) >= 4 ? 4 : 1); break;        \
    case 5: CALL((max) >= 5 ? 5 : 1); break;        \
    case 6: CALL((max) >= 6 ? 6 : 1); break;

static void pass32(const wtile *t, const act_q8 *x, const int32_t *xc, int64_t nb, int rn, int sgn, float *y, int64_t ldy, int nv) {
#define CALL_S(n) tile32(t, x, xc, nb, n, 1, 0, y, ldy, nv)
#define CALL_U(n) tile32(t, x, xc, nb, n, 0, 1, y, ldy, nv)
    if (sgn) switch (rn) { RN_CASES(RN32, CALL_S) }
    else switch (rn) { RN_CASES(RN32, CALL_U) }
#undef CALL_S
#undef CALL_U
}

static void pass_k4(const wtile *t, const act_q8k *x, const act_kside *ks, int64_t nb, int rn, int q5, const uint8_t *kind1,
                    float *y, int64_t ldy, int nv) {
#define CALL_4(n) tile_k4(t, x, ks, nb, n, 0, kind1, y, ldy, nv)
#define CALL_5(n) tile_k4(t, x, ks, nb, n, 1, kind1, y, ldy, nv)
    if (q5) switch (rn) { RN_CASES(RNK4, CALL_5) }
    else switch (rn) { RN_CASES(RNK4, CALL_4) }
#undef CALL_4
#undef CALL_5
}

static void pass_k6(const wtile *t, const act_q8k *x, const act_kside *ks, int64_t nb, int rn, float *y, int64_t ldy, int nv) {
#define CALL_6(n) tile_k6(t, x, ks, nb, n, y, ldy, nv)
    switch (rn) { RN_CASES(RNK6, CALL_6) }
#undef CALL_6
}

static void pass_k6_lanes(const wtile *t, const act_q8k *x, const act_kside *ks, int64_t nb, int rn, float *y, int64_t ldy,
                          int nv) {
#define CALL_6L(n) tile_k6_lanes(t, x, ks, nb, n, y, ldy, nv)
    switch (rn) { RN_CASES(RNK6L, CALL_6L) }
#undef CALL_6L
}
#endif /* MTP_AVX2 */

#ifndef MTP_AVX2 /* no tiles to keep */
int mtp_tiles_register(const uint8_t *W, int type, int64_t rows, int64_t k) { (void)W, (void)type, (void)rows, (void)k; return 0; }
void mtp_tiles_forget(const uint8_t *W, int type, int64_t rows, int64_t k) { (void)W, (void)type, (void)rows, (void)k; }
size_t mtp_tiles_limit(size_t bytes) { (void)bytes; return 0; }
size_t mtp_tiles_limit_now(void) { return 0; }
size_t mtp_tiles_kept_bytes(void) { return 0; }
#endif

/* ---- matmul ------------------------------------------------------------------------------------------ */

/* Per-thread scratch, kept between calls (the pool's threads persist): no malloc per matmul. */
static __thread wrow scratch_row;
static __thread int64_t scratch_row_k;
static __thread void *scratch_act[5];
static __thread size_t scratch_act_size[5];

static int scratch_row_reserve(int64_t k) {
    if (scratch_row_k >= k) return 0;
    wrow_free(&scratch_row);
    wrow_alloc(&scratch_row, k);
    wrow *r = &scratch_row;
    if (!r->q || !r->d || !r->m || !r->sc || !r->mn) {
        wrow_free(r);
        memset(r, 0, sizeof(*r));
        scratch_row_k = 0;
        return 1;
    }
    scratch_row_k = k;
    return 0;
}

static void *scratch_act_reserve(int slot, size_t size) {
    if (scratch_act_size[slot] < size) {
        free(scratch_act[slot]);
        scratch_act[slot] = malloc(size);
        scratch_act_size[slot] = scratch_act[slot] ? size : 0;
    }
    return scratch_act[slot];
}

enum { ACT_Q8 = 0, ACT_Q8K = 1, ACT_F16 = 2, ACT_XC = 3, ACT_KS = 4 }; /* XC, KS: the tiles' side arrays */

static int act_kind(int type) {
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) return ACT_Q8K;
    if (type == T_F16) return ACT_F16;
    if (type == T_F32) return -1;
    return ACT_Q8;
}

/* One output row n of weight `type` against all m activation rows; y row stride ldy. The m rows are
 * m / seq_len sequences of seq_len tokens each, and every row is rounded as llama.cpp rounds it when its
 * own sequence is the whole batch: evaluating several sequences together changes no result. */
static void matmul_row(int type, const uint8_t *src, int64_t k, const float *x, const void *const *act, int64_t m,
                       int64_t seq_len, float *y, int64_t ldy, wrow *r) {
    if (type == T_F32 || type == T_F16) {
        for (int64_t i = 0; i < m; i++)
            y[i * ldy] = type == T_F16 ? dot_f16((const half *)src, (const half *)act[ACT_F16] + i * k, k)
                                       : dot_f32((const float *)src, x + i * k, k);
        return;
    }
    const act_q8k *xk = act[ACT_Q8K];
    const act_q8 *x8 = act[ACT_Q8];
    const int tiled = seq_len >= 8;
    const int64_t m_x4 = seq_len - seq_len % 4;
#ifdef MTP_AVX2
    if (seq_len < 8 && type != T_Q5_K) { /* short sequences (decode, draft verification): fused, no decoded row */
        for (int64_t i = 0; i < m; i++) {
            float v;
            if (type == T_Q4_K) v = dot_q4k_direct(src, xk + i * (k / 256), k / 256, i % seq_len < m_x4 ? 1 : 0);
            else if (type == T_Q6_K) v = dot_q6k_direct(src, xk + i * (k / 256), k / 256, 0);
            else v = dot32_direct(type, src, x8 + i * (k / 32), k / 32);
            y[i * ldy] = v;
        }
        return;
    }
#endif
    decode_row(type, src, k, r);
    for (int64_t i = 0; i < m; i++) {
        float v;
        if (type == T_Q4_K) v = dot_k4(r, xk + i * (k / 256), k / 256, i % seq_len < m_x4 ? 1 : 0);
        else if (type == T_Q5_K) v = dot_k4(r, xk + i * (k / 256), k / 256, tiled ? 2 : 0);
        else if (type == T_Q6_K) v = dot_k6(r, xk + i * (k / 256), k / 256, tiled);
        else {
            const int is_signed = type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0;
            v = dot32(r, x8 + i * (k / 32), k / 32, is_signed, !is_signed);
        }
        y[i * ldy] = v;
    }
}

typedef struct {
    int n_w;
    const int *types;
    const uint8_t *const *W;
    const int64_t *rows;
    int64_t k;
    const float *x;
    const void *const *act;
    int64_t m, seq_len;
    float *const *y;
    int tiled; /* some of the weights go through the tiles (tiles_take) */
    const void *const *kept; /* per weight: its kept tiles (wtile *) or NULL */
    _Atomic int failed;
} matmul_job;

/* Batches go through the tiles where tiles_take says, unless a test turned them off (mtp_gemm_tiling). */
static _Atomic int gemm_tiling = 1;

/* Test hook: mtp_gemm_tiling(0) sends every batch down the per-row path (the reference the tiled path
 * must equal bit for bit), mtp_gemm_tiling(1) restores the tiles; returns the previous setting. */
int mtp_gemm_tiling(int on) { return atomic_exchange(&gemm_tiling, on != 0); }

#ifdef MTP_AVX2
/* Output rows [lo, hi) of one weight: a tile of GEMM_LW rows at a time, decoded once, against all m rows. With kept
 * tiles (kept_tiles), each whole one is used as kept; a range starting inside one packs up to its end. */
static void gemm_rows(const matmul_job *j, int type, const uint8_t *W, const wtile *kept, int64_t lo, int64_t hi,
                      float *y, int64_t ldy) {
    const int64_t k = j->k, m = j->m, rb = row_bytes(type, k), seq_len = j->seq_len, m_x4 = seq_len - seq_len % 4;
    const act_q8 *x8 = j->act[ACT_Q8];
    const act_q8k *xk = j->act[ACT_Q8K];
    const int32_t *xc = j->act[ACT_XC];
    const act_kside *ks = j->act[ACT_KS];
    const int short_k6 = type == T_Q6_K && seq_len < 8; /* the decode rule's eight lanes a row */
    const int rn_max = short_k6 ? RNK6L : type == T_Q6_K ? RNK6 : type == T_Q4_K || type == T_Q5_K ? RNK4 : RN32;
    for (int64_t n0 = lo, nv; n0 < hi; n0 += nv) {
        const wtile *tile = &scratch_tile;
        const int64_t end = kept ? (n0 / GEMM_LW + 1) * GEMM_LW : n0 + GEMM_LW; /* kept: up to the tile's end */
        nv = (hi < end ? hi : end) - n0;
        if (kept && n0 % GEMM_LW == 0) tile = &kept[n0 / GEMM_LW];
        else wtile_pack(type, W + n0 * rb, rb, (int)nv, k, &scratch_tile);
        for (int64_t i0 = 0; i0 < m; i0 += rn_max) {
            const int rn = m - i0 < rn_max ? (int)(m - i0) : rn_max;
            float *yi = y + i0 * ldy + n0;
            if (short_k6) {
                pass_k6_lanes(tile, xk + i0 * (k / 256), ks + i0 * (k / 256), k / 256, rn, yi, ldy, (int)nv);
            } else if (type == T_Q6_K) {
                pass_k6(tile, xk + i0 * (k / 256), ks + i0 * (k / 256), k / 256, rn, yi, ldy, (int)nv);
            } else if (type == T_Q4_K || type == T_Q5_K) {
                uint8_t kind1[RNK4];
                for (int i = 0; i < rn; i++) kind1[i] = (i0 + i) % seq_len < m_x4;
                pass_k4(tile, xk + i0 * (k / 256), ks + i0 * (k / 256), k / 256, rn, type == T_Q5_K, kind1, yi, ldy, (int)nv);
            } else {
                pass32(tile, x8 + i0 * (k / 32), xc ? xc + i0 * (k / 4) : NULL, k / 32, rn, signed_type(type), yi, ldy, (int)nv);
            }
        }
    }
}
#endif

/* Output rows [begin, end) of the concatenation of the job's weights. */
#ifdef MTP_AVX2
/* Four Q4_K or Q6_K weight rows against m activation rows of kind 0, streamed */
static inline __attribute__((always_inline)) void streamed_x4(int type, const uint8_t *w, int64_t rb, const act_q8k *x,
                                                             int64_t nb, const int m, float *out) {
    if (type == T_Q6_K) dot_q6k_rows_x4(w, rb, x, nb, m, out);
    else dot_q4k_rows_x4(w, rb, x, nb, m, out);
}

/* Rows [lo, hi) of a short-sequence batch in groups of four (the Q4_K and Q6_K _x4 dots, dot32_direct_x4);
 * returns the first row left over (fewer than four), for the per-row path. */
static int64_t gemv_rows_x4(const matmul_job *j, int type, const uint8_t *W, int64_t rb, int64_t lo, int64_t hi,
                            float *y, int64_t ldy) {
    const act_q8k *xk = j->act[ACT_Q8K];
    const act_q8 *x8 = j->act[ACT_Q8];
    const int64_t nb = j->k / 256, nb32 = j->k / 32, m_x4 = j->seq_len - j->seq_len % 4;
    int64_t n = lo;
    for (; n + 4 <= hi; n += 4) {
        if (type == T_Q6_K || type == T_Q4_K) { /* up to four activation rows a pass: each weight block unpacked once */
            for (int64_t i = 0; i < j->m; i += 4) {
                const int mi = j->m - i < 4 ? (int)(j->m - i) : 4;
                float out[16];
                const uint8_t *w = W + n * rb;
                const act_q8k *xi = xk + i * nb;
                int kind[4], any1 = 0; /* the float steps of each activation row (Q4_K: dot_q4k_direct's kind) */
                for (int ii = 0; ii < mi; ii++) any1 |= kind[ii] = type == T_Q4_K && (i + ii) % j->seq_len < m_x4;
                if (any1) dot_q4k_direct_x4(w, rb, xi, nb, mi, kind, out); /* a sequence of 4-7 rows */
                else
                    switch (mi) { /* m a constant in each call */
                        case 1: streamed_x4(type, w, rb, xi, nb, 1, out); break;
                        case 2: streamed_x4(type, w, rb, xi, nb, 2, out); break;
                        case 3: streamed_x4(type, w, rb, xi, nb, 3, out); break;
                        default: streamed_x4(type, w, rb, xi, nb, 4, out); break;
                    }
                for (int ii = 0; ii < mi; ii++) memcpy(y + (i + ii) * ldy + n, out + 4 * ii, 4 * sizeof(float));
            }
            continue;
        }
        for (int64_t i = 0; i < j->m; i++) {
            const uint8_t *w = W + n * rb;
            const act_q8 *xi = x8 + i * nb32;
            float out[4];
            /* the type a constant in each call: load_q32's layout resolved at compile time, not a switch a block
             * (which cost Gemma 3's decode a quarter of its speed, and made Q4_1 measure slower four rows a pass) */
            switch (type) {
                case T_Q4_0: dot32_direct_x4(T_Q4_0, w, rb, xi, nb32, out); break;
                case T_Q4_1: dot32_direct_x4(T_Q4_1, w, rb, xi, nb32, out); break;
                case T_Q5_0: dot32_direct_x4(T_Q5_0, w, rb, xi, nb32, out); break;
                case T_Q5_1: dot32_direct_x4(T_Q5_1, w, rb, xi, nb32, out); break;
                default: dot32_direct_x4(T_Q8_0, w, rb, xi, nb32, out); break;
            }
            memcpy(y + i * ldy + n, out, sizeof(out));
        }
    }
    return n;
}
#endif

static void matmul_rows(void *ctx, int64_t begin, int64_t end) {
    matmul_job *j = ctx;
    if (scratch_row_reserve(j->k)) {
        j->failed = 1;
        return;
    }
    int64_t base = 0; /* first global row of weight w */
    for (int w = 0; w < j->n_w && base < end; base += j->rows[w], w++) {
        const int64_t lo = begin > base ? begin - base : 0, hi = end - base < j->rows[w] ? end - base : j->rows[w];
        const int64_t rb = row_bytes(j->types[w], j->k);
#ifdef MTP_AVX2
        if (j->tiled && tiles_take(j->types[w], j->m, j->seq_len)) {
            if (scratch_tile_reserve(j->k)) {
                j->failed = 1;
                return;
            }
            gemm_rows(j, j->types[w], j->W[w], j->kept[w], lo, hi, j->y[w], j->rows[w]);
            continue;
        }
#endif
        int64_t n = lo;
#ifdef MTP_AVX2
        /* four rows a pass where decode measured faster than row by row (the activation block loaded once for four
         * rows, each row prefetching its own stream: prefetch_x4): Q4_K and Q6_K (the 27B's widths: tg64 +34%),
         * Q5_0 and Q8_0 (Gemma 3 270M's: +19%, on the Intel AVX-512 VM), Q4_1 (SmolLM2's: +13%), and Q4_0 and Q5_1
         * as their likes (no model here has them; the twin test holds them). Q5_K goes row by row (its
         * short-sequence rounding). Q8_0 without AVX-512 VNNI too: on a 2-core AVX2 AMD EPYC its four streams read
         * Gemma 3's 178 MB output layer at 15-17 GB/s, one row at a time at 22-25 (tg64 +23-27%). */
        const int t = j->types[w];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const int q8_x4 = 1;
#else
        const int q8_x4 = 0;
#endif
        const int x4 = t == T_Q4_K || t == T_Q6_K || t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 ||
                       (t == T_Q8_0 && q8_x4);
        if (x4 && j->seq_len < 8 && atomic_load(&gemm_tiling))
            n = gemv_rows_x4(j, j->types[w], j->W[w], rb, lo, hi, j->y[w], j->rows[w]); /* decode: four rows a pass */
#endif
        for (; n < hi; n++)
            matmul_row(j->types[w], j->W[w] + n * rb, j->k, j->x, j->act, j->m, j->seq_len, j->y[w] + n, j->rows[w], &scratch_row);
    }
}

typedef struct {
    const float *x;
    int64_t k;
    void *const *act; /* the slots to fill (NULL: not needed) */
} round_job;

/* Activation rows [begin, end) rounded to each vec-dot type needed, and the tiles' side arrays of them. */
static void round_rows(void *ctx, int64_t begin, int64_t end) {
    const round_job *j = ctx;
    const int64_t k = j->k;
    for (int64_t i = begin; i < end; i++) {
        const float *x = j->x + i * k;
        if (j->act[ACT_Q8K]) quantize_q8k(x, k, (act_q8k *)j->act[ACT_Q8K] + i * (k / 256));
        if (j->act[ACT_Q8]) quantize_q8(x, k, (act_q8 *)j->act[ACT_Q8] + i * (k / 32));
        if (j->act[ACT_F16])
            for (int64_t c = 0; c < k; c++) ((half *)j->act[ACT_F16])[i * k + c] = f2h(x[c]);
#ifdef MTP_AVX2
        if (j->act[ACT_XC]) xcorr_row((const act_q8 *)j->act[ACT_Q8] + i * (k / 32), k / 32, (int32_t *)j->act[ACT_XC] + i * (k / 4));
        if (j->act[ACT_KS])
            kside_row((const act_q8k *)j->act[ACT_Q8K] + i * (k / 256), k / 256, (act_kside *)j->act[ACT_KS] + i * (k / 256));
#endif
    }
}

/* Work below this many weight-activation products runs on the calling thread: waking the pool costs more. */
#define MTP_PARALLEL_MIN_WORK 65536

/* y_j[m, rows_j] = x[m, k] W_j^T for n_w weights sharing the input x (float32 row-major): the
 * activations are rounded once per vec-dot type and all rows are split over one parallel region. */
int mtp_matmul_many(int n_w, const int *types, const uint8_t *const *W, const int64_t *rows, int64_t k,
                    const float *x, int64_t m, int64_t seq_len, float *const *y, int n_threads) {
    if (seq_len <= 0 || m % seq_len) return 1;
    int64_t total = 0;
    int need[3] = {0, 0, 0};
    for (int j = 0; j < n_w; j++) {
        if (row_bytes(types[j], k) < 0 || (types[j] != T_F32 && types[j] != T_F16 && k % row_block(types[j]))) return 1;
        total += rows[j];
        const int a = act_kind(types[j]);
        if (a >= 0) need[a] = 1;
    }
    void *act[5] = {NULL, NULL, NULL, NULL, NULL};
    if (need[ACT_Q8K] && !(act[ACT_Q8K] = scratch_act_reserve(ACT_Q8K, sizeof(act_q8k) * (k / 256) * m))) return 2;
    if (need[ACT_Q8] && !(act[ACT_Q8] = scratch_act_reserve(ACT_Q8, sizeof(act_q8) * (k / 32) * m))) return 2;
    if (need[ACT_F16] && !(act[ACT_F16] = scratch_act_reserve(ACT_F16, sizeof(half) * k * m))) return 2;
    int tiled = 0;
#ifdef MTP_AVX2
    for (int j = 0; j < n_w; j++) tiled |= tiles_take(types[j], m, seq_len);
    tiled = tiled && atomic_load(&gemm_tiling);
    int need_xc = 0, need_ks = 0;
    for (int j = 0; tiled && j < n_w; j++) {
        if (!tiles_take(types[j], m, seq_len)) continue;
#ifdef GEMM_VNNI
        need_xc |= signed_type(types[j]);
#endif
        need_ks |= types[j] == T_Q4_K || types[j] == T_Q5_K || types[j] == T_Q6_K;
    }
    if (need_xc && !(act[ACT_XC] = scratch_act_reserve(ACT_XC, sizeof(int32_t) * (k / 4) * m))) return 2;
    if (need_ks && !(act[ACT_KS] = scratch_act_reserve(ACT_KS, sizeof(act_kside) * (k / 256) * m))) return 2;
#endif
    round_job rounding = {x, k, act};
    round_rows(&rounding, 0, m); /* on the calling thread: a few percent of the work, and one pool call per matmul */
    const void *kept[n_w];
    const int threads = total * k * m >= MTP_PARALLEL_MIN_WORK ? n_threads : 1;
    for (int j = 0; j < n_w; j++) {
        kept[j] = NULL;
#ifdef MTP_AVX2
        if (tiled && tiles_take(types[j], m, seq_len)) kept[j] = kept_tiles(W[j], types[j], rows[j], k, n_threads);
#endif
    }
    matmul_job job = {n_w, types, W, rows, k, x, (const void *const *)act, m, seq_len, y, tiled, kept, 0};
    int64_t grain = chunk_grain(total, threads, 4, 4);
#ifdef MTP_AVX2
    if (tiled) grain = (grain + GEMM_LW - 1) / GEMM_LW * GEMM_LW; /* whole tiles */
#endif
    mtp_parallel_for(total, grain, threads, matmul_rows, &job);
    return job.failed ? 2 : 0;
}

/* y[m, n] = sum_k x[m, k] * W[n, k]; W is n_rows GGUF rows of type `type`; x, y float32 row-major;
 * x holds m / seq_len sequences of seq_len tokens (seq_len = m: one sequence). */
int mtp_matmul(int type, const uint8_t *W, int64_t n_rows, int64_t k, const float *x, int64_t m, int64_t seq_len,
               float *y, int n_threads) {
    return mtp_matmul_many(1, &type, &W, &n_rows, k, x, m, seq_len, &y, n_threads);
}

/* ---- embedding rows ---------------------------------------------------------------------------------- */

/* out[i, :] = the dequantized row idx[i] of W [n_rows, k], with the float operations of mtpserve's (and gguf-py's)
 * dequantizers: d * q (+ m) for 32-blocks, (d * sc) * q - dmin * mn for Q4_K/Q5_K, (d * sc) * (q - 32) for Q6_K.
 * Returns 3, writing nothing, when an index is outside [0, n_rows). */
int mtp_get_rows(int type, const uint8_t *W, int64_t n_rows, int64_t k, const int64_t *idx, int64_t n, float *out) {
    const int64_t rb = row_bytes(type, k);
    if (rb < 0 || (type != T_F32 && type != T_F16 && k % row_block(type))) return 1;
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= n_rows) return 3;
    if (scratch_row_reserve(k)) return 2;
    wrow *r = &scratch_row;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *src = W + idx[i] * rb;
        float *o = out + i * k;
        if (type == T_F32) { memcpy(o, src, sizeof(float) * k); continue; }
        if (type == T_F16) { for (int64_t j = 0; j < k; j++) o[j] = h2f(((const half *)src)[j]); continue; }
        decode_row(type, src, k, r);
        switch (type) {
            case T_Q4_1:
            case T_Q5_1:
                for (int64_t j = 0; j < k; j++) o[j] = (float)(uint8_t)r->q[j] * r->d[j / 32] + r->m[j / 32];
                break;
            case T_Q4_K:
            case T_Q5_K:
                for (int64_t j = 0; j < k; j++) {
                    const int64_t s = j / 32, b = j / 256;
                    const float dd = r->d[b] * (float)r->sc[s], dm = r->m[b] * (float)r->mn[s];
                    o[j] = (float)(uint8_t)r->q[j] * dd - dm;
                }
                break;
            case T_Q6_K:
                for (int64_t j = 0; j < k; j++)
                    o[j] = (float)((int)(uint8_t)r->q[j] - 32) * (r->d[j / 256] * (float)r->sc[j / 16]);
                break;
            default: /* Q4_0, Q5_0, Q8_0: signed values */
                for (int64_t j = 0; j < k; j++) o[j] = (float)r->q[j] * r->d[j / 32];
        }
    }
    return 0;
}
