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
 * A weight row is decoded once into bytes and then dotted with every activation row of the batch.
 */

#include "common.h"

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

/* llama.cpp x86 quantize_row_q8_0/q8_1: d = amax/127, q = round_half_even(x * (127/amax)). */
static void quantize_q8(const float *x, int64_t k, act_q8 *y) {
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

static float dot32_direct(int type, const uint8_t *src, const act_q8 *x, int64_t nb) {
    const int64_t bs = row_bytes(type, 32);
    const int is_signed = type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0;
    __m256 vacc = _mm256_setzero_ps();
    float vsumms = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        float d, m = 0.0f;
        const __m256i w = load_q32(type, src + b * bs, &d, &m);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i p = is_signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                                    : _mm256_maddubs_epi16(w, xv);
        if (!is_signed) vsumms = fmaf(m, x[b].s, vsumms);
        const __m256 lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
        vacc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), lanes, vacc);
    }
    float out[8];
    _mm256_storeu_ps(out, vacc);
    return hsum8(out) + vsumms;
}

static inline int32_t hsum_v8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* The eight 6-bit scales (bytes 0..7 of *sc) and mins (bytes 0..7 of *mn) of a Q4_K/Q5_K super-block,
 * unpacked with 32-bit masks: scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 / 4-7; scales and
 * mins 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from the top of bytes 0-3 / 4-7. */
static inline void k_scales_mins8(const uint8_t *packed, uint64_t *sc, uint64_t *mn) {
    uint32_t u[3];
    memcpy(u, packed, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    const uint32_t sc_lo = u[0] & low6, mn_lo = u[1] & low6;
    const uint32_t sc_hi = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
    *sc = (uint64_t)sc_lo | ((uint64_t)sc_hi << 32);
    *mn = (uint64_t)mn_lo | ((uint64_t)mn_hi << 32);
}

/* dot_k4 (kinds 0 and 1) from the block bytes; the integer sums are exact, so their order is free. */
static float dot_q4k_direct(const uint8_t *src, const act_q8k *x, int64_t nb, int kind) {
    float acc = 0.0f, accm = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = src + 144 * b, *qs = blk + 16;
        half hd, hdm;
        memcpy(&hd, blk, 2);
        memcpy(&hdm, blk + 2, 2);
        uint64_t sc64, mn64;
        k_scales_mins8(blk + 4, &sc64, &mn64);
        const uint8_t *sc = (const uint8_t *)&sc64;
        /* mins: sum_j mn[j] * (bsums[2j] + bsums[2j + 1]) */
        const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)x[b].bsums), _mm_loadu_si128((const __m128i *)(x[b].bsums + 8)));
        const __m128i prod_m = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn64)), bs); /* 4 x int32: c = 0..3 */
        __m256i total = _mm256_setzero_si256();
        int32_t sumi[4];
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(v, m4), _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * c)));
            const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                                    _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * c + 32)));
            const __m256i part = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi16(sc[2 * c])),
                                                  _mm256_madd_epi16(hi, _mm256_set1_epi16(sc[2 * c + 1])));
            if (kind == 1) sumi[c] = hsum_v8(part);
            else total = _mm256_add_epi32(total, part);
        }
        const float d = h2f(hd) * x[b].d, dmin = h2f(hdm) * x[b].d;
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

/* dot_k6 from the block bytes: the same eight integer lanes as k6_lanes over the decoded row. */
static float dot_q6k_direct(const uint8_t *src, const act_q8k *x, int64_t nb, int tiled) {
    float acc[8], acc1 = 0.0f;
    __m256 vacc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nb; b++) {
        const blk_q6_K *w = (const blk_q6_K *)(src + 210 * b);
        __m256i sum = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w->qh + 32 * n));
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * n));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * n + 32));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            for (int j = 0; j < 4; j++) {
                const int v = 4 * n + j;
                const __m256i p = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * v)));
                const __m256i s = _mm256_set_m128i(_mm_set1_epi16((short)w->scales[2 * v + 1]), _mm_set1_epi16((short)w->scales[2 * v]));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, s));
            }
        }
        /* lane l -= 32 (scale[2l] bsum[2l] + scale[2l + 1] bsum[2l + 1]) */
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->scales));
        const __m256i offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256((const __m256i *)x[b].bsums));
        sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(offset, 5));
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
#endif

/* ---- matmul ------------------------------------------------------------------------------------------ */

/* Per-thread scratch, kept between calls (OpenMP's pool threads persist): no malloc per matmul. */
static __thread wrow scratch_row;
static __thread int64_t scratch_row_k;
static __thread void *scratch_act[3];
static __thread size_t scratch_act_size[3];

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

enum { ACT_Q8 = 0, ACT_Q8K = 1, ACT_F16 = 2 };

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
    void *act[3] = {NULL, NULL, NULL};
    if (need[ACT_Q8K] && !(act[ACT_Q8K] = scratch_act_reserve(ACT_Q8K, sizeof(act_q8k) * (k / 256) * m))) return 2;
    if (need[ACT_Q8] && !(act[ACT_Q8] = scratch_act_reserve(ACT_Q8, sizeof(act_q8) * (k / 32) * m))) return 2;
    if (need[ACT_F16] && !(act[ACT_F16] = scratch_act_reserve(ACT_F16, sizeof(half) * k * m))) return 2;
    for (int64_t i = 0; i < m; i++) {
        if (need[ACT_Q8K]) quantize_q8k(x + i * k, k, (act_q8k *)act[ACT_Q8K] + i * (k / 256));
        if (need[ACT_Q8]) quantize_q8(x + i * k, k, (act_q8 *)act[ACT_Q8] + i * (k / 32));
    }
    if (need[ACT_F16])
        for (int64_t i = 0; i < k * m; i++) ((half *)act[ACT_F16])[i] = f2h(x[i]);
    set_threads(n_threads);
    int failed = 0;
#pragma omp parallel if (total * k * m >= MTP_PARALLEL_MIN_WORK)
    {
        int64_t begin = 0, end = total;
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        begin = total * t / nt;
        end = total * (t + 1) / nt;
#endif
        if (scratch_row_reserve(k)) {
#pragma omp atomic write
            failed = 1;
        } else {
            int64_t base = 0; /* first global row of weight j */
            for (int j = 0; j < n_w && base < end; base += rows[j], j++) {
                const int64_t lo = begin > base ? begin - base : 0, hi = end - base < rows[j] ? end - base : rows[j];
                const int64_t rb = row_bytes(types[j], k);
                for (int64_t n = lo; n < hi; n++)
                    matmul_row(types[j], W[j] + n * rb, k, x, (const void *const *)act, m, seq_len, y[j] + n, rows[j], &scratch_row);
            }
        }
    }
    return failed ? 2 : 0;
}

/* y[m, n] = sum_k x[m, k] * W[n, k]; W is n_rows GGUF rows of type `type`; x, y float32 row-major;
 * x holds m / seq_len sequences of seq_len tokens (seq_len = m: one sequence). */
int mtp_matmul(int type, const uint8_t *W, int64_t n_rows, int64_t k, const float *x, int64_t m, int64_t seq_len,
               float *y, int n_threads) {
    return mtp_matmul_many(1, &type, &W, &n_rows, k, x, m, seq_len, &y, n_threads);
}

/* ---- embedding rows ---------------------------------------------------------------------------------- */

/* out[i, :] = the dequantized row idx[i] of W, with the float operations of mtpserve's (and gguf-py's)
 * dequantizers: d * q (+ m) for 32-blocks, (d * sc) * q - dmin * mn for Q4_K/Q5_K, (d * sc) * (q - 32) for Q6_K. */
int mtp_get_rows(int type, const uint8_t *W, int64_t k, const int64_t *idx, int64_t n, float *out) {
    const int64_t rb = row_bytes(type, k);
    if (rb < 0 || (type != T_F32 && type != T_F16 && k % row_block(type))) return 1;
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
