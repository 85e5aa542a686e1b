/*
 * mtpserve CPU kernels: shared definitions. The kernels follow llama.cpp's CPU rounding rules (see
 * ../../ops/linear.py and ../../ops/attention.py for the rules and their PyTorch twins); matmul.c,
 * attention.c and elementwise.c are compiled together into one library by __init__.py and called via
 * ctypes; every entry point returns 0 on success.
 */
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MTP_AVX2 1
#endif

typedef uint16_t half;

static inline float h2f(half h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

static inline half f2h(float x) {
    _Float16 f = (_Float16)x; /* IEEE round-to-nearest-even */
    half h;
    memcpy(&h, &f, 2);
    return h;
}

/* pool.c: fn(ctx, begin, end) over items [0, n) in chunks of `grain`, on the caller and up to n_threads - 1
 * pool workers; returns when every item is done. Items must write disjoint outputs. */
typedef void (*mtp_task_fn)(void *ctx, int64_t begin, int64_t end);
void mtp_parallel_for(int64_t n, int64_t grain, int n_threads, mtp_task_fn fn, void *ctx);

/* Float scratch of the calling thread, grown on demand and kept between calls: no allocation per call. Each
 * source file that includes this has its own buffer, so a kernel may hold its buffer while calling another file's. */
static inline float *thread_floats(int64_t n) {
    static __thread float *buf;
    static __thread int64_t size;
    if (size < n) {
        free(buf);
        buf = malloc(sizeof(float) * n);
        size = buf ? n : 0;
    }
    return buf;
}

/* A chunk size giving each of n_threads about `per_thread` chunks, so a thread set aside by the scheduler
 * holds back little, and never below min_grain items. */
static inline int64_t chunk_grain(int64_t n, int n_threads, int per_thread, int64_t min_grain) {
    const int64_t parts = (int64_t)(n_threads > 1 ? n_threads : 1) * per_thread;
    const int64_t g = (n + parts - 1) / parts;
    return g > min_grain ? g : min_grain;
}

/* ((0+4)+(2+6)) + ((1+5)+(3+7)): how llama.cpp's AVX2 kernels sum eight float lanes */
static inline float hsum8(const float a[8]) {
    float r0 = a[4] + a[0], r1 = a[5] + a[1], r2 = a[6] + a[2], r3 = a[7] + a[3];
    r0 = r0 + r2;
    r1 = r1 + r3;
    return r0 + r1;
}

/* F16/F32 dot products: 32 values per step in four 8-lane accumulators, reduced (0+2, 1+3), then 0+1,
 * then the 8 lanes as ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7)); the tail in double (ggml_vec_dot_f16/f32). */
static inline float reduce_4x8(float s[4][8]) {
    float r[8];
    for (int l = 0; l < 8; l++) r[l] = (s[0][l] + s[2][l]) + (s[1][l] + s[3][l]);
    const float a0 = r[0] + r[4], a1 = r[1] + r[5], a2 = r[2] + r[6], a3 = r[3] + r[7];
    return (a0 + a1) + (a2 + a3);
}

#ifdef MTP_AVX2 /* the same per-lane fused multiply-adds and the same additions, eight lanes at a time */
static inline float reduce_4x8_v(const __m256 acc[4]) {
    const __m256 r = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1)); /* a_l = r_l + r_{l+4} */
    const __m128 pairs = _mm_hadd_ps(a, a);                                                /* a0 + a1, a2 + a3 */
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
#endif

static inline float dot_f16(const half *w, const half *x, int64_t k) {
    const int64_t np = k & ~31;
#ifdef MTP_AVX2
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < np; i += 32)
        for (int j = 0; j < 4; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + 8 * j))),
                                     _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i + 8 * j))), acc[j]);
    double sum = reduce_4x8_v(acc);
#else
    float s[4][8] = {{0}};
    for (int64_t i = 0; i < np; i += 32)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++) s[j][l] = fmaf(h2f(w[i + 8 * j + l]), h2f(x[i + 8 * j + l]), s[j][l]);
    double sum = reduce_4x8(s);
#endif
    for (int64_t i = np; i < k; i++) sum += (double)(h2f(w[i]) * h2f(x[i]));
    return (float)sum;
}
static inline float dot_f32(const float *w, const float *x, int64_t k) {
    const int64_t np = k & ~31;
#ifdef MTP_AVX2
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < np; i += 32)
        for (int j = 0; j < 4; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8 * j), _mm256_loadu_ps(x + i + 8 * j), acc[j]);
    double sum = reduce_4x8_v(acc);
#else
    float s[4][8] = {{0}};
    for (int64_t i = 0; i < np; i += 32)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++) s[j][l] = fmaf(w[i + 8 * j + l], x[i + 8 * j + l], s[j][l]);
    double sum = reduce_4x8(s);
#endif
    for (int64_t i = np; i < k; i++) sum += (double)(w[i] * x[i]);
    return (float)sum;
}

/* out[0..n) <- in's f16 values as float */
static inline void f16_to_float(float *out, const half *in, int64_t n) {
    int64_t i = 0;
#ifdef MTP_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
#endif
    for (; i < n; i++) out[i] = h2f(in[i]);
}

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* exp(x) by the Arm Optimized Routines vector algorithm (the one llama.cpp's CPU SiLU and softmax use): n =
 * round(x / ln2) by the 1.5*2^23 shift, b = x - n ln2 in two parts, exp(b) - 1 by a degree-5 polynomial,
 * scaled by 2^n through the exponent bits, with the large-|n| cases split to avoid overflow. */
static inline float expf_arm(float x) {
    const float shift = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, shift);
    const float n = z - shift;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const uint32_t e = f2u(z) << 23;
    const float k = u2f(e + f2u(1.0f));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         0x1.ffffecp-1f * b);
    if (!(fabsf(n) > 126.0f)) return fmaf(j, k, k);
    const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
    const float s1 = u2f(g + 0x7f000000u);
    const float s2 = u2f(e - g);
    if (fabsf(n) > 192.0f) return s1 * s1;
    return fmaf(s2, j, s2) * s1;
}

#ifdef MTP_AVX2
/* expf_arm of eight lanes, each lane the same operations (a masked key's -inf included: 0). */
static inline __m256 expf_arm8(__m256 x) {
    const __m256 shift = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), shift);
    const __m256 n = _mm256_sub_ps(z, shift);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32((int)0x3f800000)));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    const __m256 fast = _mm256_fmadd_ps(j, k, k);
    const __m256 an = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
    const __m256 big = _mm256_cmp_ps(an, _mm256_set1_ps(126.0f), _CMP_GT_OQ);
    if (_mm256_testz_ps(big, big)) return fast;
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256 huge = _mm256_cmp_ps(an, _mm256_set1_ps(192.0f), _CMP_GT_OQ);
    const __m256 slow = _mm256_blendv_ps(_mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1), _mm256_mul_ps(s1, s1), huge);
    return _mm256_blendv_ps(fast, slow, big);
}

/* hsum8 of the lanes of v */
static inline float hsum8_v(__m256 v) {
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* a[i] + a[i + 4] */
    const __m128 t = _mm_add_ps(r, _mm_movehl_ps(r, r));                                  /* r0 + r2, r1 + r3 */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif
