#include "common.h"

#include <stdatomic.h>

/* ---- attention ------------------------------------------------------------------------------------ */

/* One query row against keys [s0, s1): online softmax in key order, skipping masked keys. Leaves the
 * unnormalized accumulator in acc (f32) and returns max and sum through *M, *Ssum. */
static void attend_row(const float *qv, const half *qh, const void *kp, const void *vp, int kv_f16, int64_t qpos,
                       const int64_t *k_pos, int64_t s0, int64_t s1, int64_t Hkv, int64_t hk, int64_t D, float scale,
                       int64_t window, int v_acc_f16, float *acc, float *Mout, float *Sout) {
    float M = -INFINITY, Ssum = 0.0f;
    for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t delta = qpos - k_pos[s];
        if (delta < 0 || (window > 0 && delta >= window)) continue;
        float score;
        if (kv_f16) score = dot_f16((const half *)kp + (s * Hkv + hk) * D, qh, D);
        else score = dot_f32((const float *)kp + (s * Hkv + hk) * D, qv, D);
        score *= scale;
        float ms = 1.0f, vs = 1.0f;
        if (score > M) {
            const float Mold = M;
            M = score;
            ms = expf(Mold - M);
            for (int64_t d = 0; d < D; d++) acc[d] = v_acc_f16 ? h2f(f2h(acc[d] * ms)) : acc[d] * ms;
        } else {
            vs = expf(score - M);
        }
#ifdef MTP_AVX2
        if (kv_f16 && D % 8 == 0) { /* acc = round_f16?(fma(v, vs, acc)), eight values at a time */
            const half *v = (const half *)vp + (s * Hkv + hk) * D;
            const __m256 vsv = _mm256_set1_ps(vs);
            for (int64_t d = 0; d < D; d += 8) {
                __m256 a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + d))), vsv, _mm256_loadu_ps(acc + d));
                if (v_acc_f16) a = _mm256_cvtph_ps(_mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
                _mm256_storeu_ps(acc + d, a);
            }
            Ssum = fmaf(Ssum, ms, vs);
            continue;
        }
#endif
        if (kv_f16) {
            const half *v = (const half *)vp + (s * Hkv + hk) * D;
            for (int64_t d = 0; d < D; d++) {
                const float a = fmaf(h2f(v[d]), vs, acc[d]);
                acc[d] = v_acc_f16 ? h2f(f2h(a)) : a;
            }
        } else {
            const float *v = (const float *)vp + (s * Hkv + hk) * D;
            for (int64_t d = 0; d < D; d++) {
                const float a = fmaf(v[d], vs, acc[d]);
                acc[d] = v_acc_f16 ? h2f(f2h(a)) : a;
            }
        }
        Ssum = fmaf(Ssum, ms, vs);
    }
    *Mout = M;
    *Sout = Ssum;
}

#define ROW_KEYS 64 /* keys whose scores and weights are found before their values are summed */
#ifdef MTP_AVX2

static inline __m256 round_acc(__m256 a, int v_acc_f16) {
    return v_acc_f16 ? _mm256_cvtph_ps(_mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT)) : a;
}

/* acc[d..d + 8 NV) through the keys' steps in order: rescaled by ms[j] where the max moved (rescale[j]), then
 * fma(v_j, vs[j], acc), each rounded to f16 with v_acc_f16: attend_row's steps, the dims in registers */
#define ROW_VALUES(NV)                                                                                                 \
    do {                                                                                                               \
        __m256 a[NV];                                                                                                  \
        for (int v = 0; v < NV; v++) a[v] = _mm256_loadu_ps(acc + d + 8 * v);                                          \
        for (int j = 0; j < n; j++) {                                                                                  \
            if (!live[j]) continue;                                                                                    \
            if (rescale[j]) {                                                                                          \
                const __m256 m = _mm256_set1_ps(ms[j]);                                                                \
                for (int v = 0; v < NV; v++) a[v] = round_acc(_mm256_mul_ps(a[v], m), v_acc_f16);                      \
            }                                                                                                          \
            const __m256 w = _mm256_set1_ps(vs[j]);                                                                    \
            for (int v = 0; v < NV; v++) a[v] = round_acc(_mm256_fmadd_ps(_mm256_loadu_ps(vf + j * D + d + 8 * v), w, a[v]), v_acc_f16); \
        }                                                                                                              \
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(acc + d + 8 * v, a[v]);                                          \
    } while (0)

/* attend_row over an f16 cache for the `group` query heads of one KV head (D % 8 == 0), each head's numbers those
 * of attend_row: keys in blocks of ROW_KEYS, each key's K row converted to float once for every head's score; each
 * head's max updates and weights (libm's expf) found in key order; the block's V rows converted once, then each
 * head's values summed into its accumulator 64 dims at a time in registers, each dim through the keys' steps in
 * order. qf, acc [group][D]; M, Ssum [group]; scratch: (ROW_KEYS + 1) D + 3 group ROW_KEYS floats. */
static void attend_group_f16(const float *qf, int64_t group, const half *kp, const half *vp, int64_t qpos,
                             const int64_t *k_pos, int64_t s_begin, int64_t s_end, int64_t Hkv, int64_t hk, int64_t D,
                             float scale, int64_t window, int v_acc_f16, float *accs, float *M, float *Ssum,
                             float *scratch) {
    float *kf = scratch, *vf = kf + D, *scores = vf + ROW_KEYS * D, *ms_all = scores + group * ROW_KEYS;
    float *vs_all = ms_all + group * ROW_KEYS;
    uint8_t live[ROW_KEYS], rescale_all[ROW_KEYS];
    for (int64_t g = 0; g < group; g++) {
        M[g] = -INFINITY;
        Ssum[g] = 0.0f;
    }
    for (int64_t i = 0; i < group * D; i++) accs[i] = 0.0f;
    for (int64_t s0 = s_begin; s0 < s_end; s0 += ROW_KEYS) {
        const int n = s_end - s0 < ROW_KEYS ? (int)(s_end - s0) : ROW_KEYS;
        int any = 0;
        for (int j = 0; j < n; j++) { /* independent of each other: the core overlaps them */
            const int64_t s = s0 + j, delta = qpos - k_pos[s];
            live[j] = !(delta < 0 || (window > 0 && delta >= window));
            if (!live[j]) continue;
            any = 1;
            f16_to_float(kf, kp + (s * Hkv + hk) * D, D); /* dot_f16 of the rows, each converted once */
            for (int64_t g = 0; g < group; g++) scores[g * ROW_KEYS + j] = dot_f32(kf, qf + g * D, D) * scale;
            f16_to_float(vf + j * D, vp + (s * Hkv + hk) * D, D);
        }
        if (!any) continue;
        for (int64_t g = 0; g < group; g++) {
            float *ms = ms_all + g * ROW_KEYS, *vs = vs_all + g * ROW_KEYS, *acc = accs + g * D;
            const float *sc = scores + g * ROW_KEYS;
            uint8_t *rescale = rescale_all;
            for (int j = 0; j < n; j++) {
                if (!live[j]) continue;
                rescale[j] = sc[j] > M[g];
                if (rescale[j]) {
                    ms[j] = expf(M[g] - sc[j]);
                    vs[j] = 1.0f;
                    M[g] = sc[j];
                } else {
                    ms[j] = 1.0f;
                    vs[j] = expf(sc[j] - M[g]);
                }
                Ssum[g] = fmaf(Ssum[g], ms[j], vs[j]);
            }
            int64_t d = 0;
            for (; d + 64 <= D; d += 64) ROW_VALUES(8);
            for (; d < D; d += 8) ROW_VALUES(1);
        }
    }
}
#endif

typedef struct {
    const float *q;
    const void *kp, *vp;
    int kv_f16, v_acc_f16;
    const int64_t *q_pos, *k_pos;
    int64_t S, H, Hkv, D, window, n_cells, n_split;
    float scale;
    float *out;
    float *parts; /* n_split > 1: each (row, head, chunk)'s accumulator, max and sum [D + 2] */
    _Atomic int failed;
} attention_job;

/* The `group` query heads of KV head hk at query row t against keys [s0, s1): acc [group][D], M, Ssum [group]
 * (attend_group_f16 where it serves, else attend_row head by head) */
static void attend_heads(const attention_job *j, int64_t t, int64_t hk, int64_t s0, int64_t s1, float *acc, float *M,
                         float *Ssum, float *qf, half *qh, float *scratch) {
    const int64_t D = j->D, H = j->H, group = H / j->Hkv;
    for (int64_t g = 0; g < group; g++) {
        const float *qv = j->q + (t * H + hk * group + g) * D;
        for (int64_t d = 0; d < D; d++) {
            qh[g * D + d] = f2h(qv[d]);
            qf[g * D + d] = h2f(qh[g * D + d]);
        }
    }
#ifdef MTP_AVX2
    if (j->kv_f16 && D % 8 == 0) {
        attend_group_f16(qf, group, j->kp, j->vp, j->q_pos[t], j->k_pos, s0, s1, j->Hkv, hk, D, j->scale, j->window,
                         j->v_acc_f16, acc, M, Ssum, scratch);
        return;
    }
#endif
    (void)scratch;
    for (int64_t g = 0; g < group; g++)
        attend_row(j->q + (t * H + hk * group + g) * D, qh + g * D, j->kp, j->vp, j->kv_f16, j->q_pos[t], j->k_pos, s0,
                   s1, j->Hkv, hk, D, j->scale, j->window, j->v_acc_f16, acc + g * D, &M[g], &Ssum[g]);
}

/* (query row, KV head) pairs [begin, end), or with n_split > 1 (query row, KV head, chunk) triples into j->parts:
 * every query head of the KV head's group at once (they read the same K and V rows) */
static void attention_rows(void *ctx, int64_t begin, int64_t end) {
    attention_job *j = ctx;
    const int64_t D = j->D, H = j->H, Hkv = j->Hkv, S = j->S, group = H / Hkv, n_split = j->n_split;
    float *acc = thread_floats(group * (3 * D + 2) + (ROW_KEYS + 1) * D + 3 * group * ROW_KEYS);
    if (!acc) {
        j->failed = 1;
        return;
    }
    float *qf = acc + group * D, *M = qf + group * D, *Ssum = M + group, *scratch = Ssum + group;
    half *qh = (half *)(scratch + (ROW_KEYS + 1) * D + 3 * group * ROW_KEYS);
    for (int64_t item = begin; item < end; item++) {
        const int64_t tk = item / n_split, c = item % n_split, t = tk / Hkv, hk = tk % Hkv;
        int64_t s0 = 0, s1 = S;
        if (n_split > 1) {
            const int64_t chunk = (j->n_cells + n_split - 1) / n_split;
            s0 = c * chunk;
            s1 = (c + 1) * chunk < S ? (c + 1) * chunk : S;
        }
        const int empty = s0 >= j->n_cells || s0 >= S; /* a chunk past the cells (or no cells): no key seen */
        if (!empty) attend_heads(j, t, hk, s0, s1, acc, M, Ssum, qf, qh, scratch);
        else
            for (int64_t g = 0; g < group; g++) {
                M[g] = -INFINITY;
                Ssum[g] = 0.0f;
                for (int64_t d = 0; d < D; d++) acc[g * D + d] = 0.0f;
            }
        for (int64_t g = 0; g < group; g++) {
            const int64_t h = hk * group + g;
            if (n_split <= 1) {
                const float inv = Ssum[g] == 0.0f ? 0.0f : 1.0f / Ssum[g];
                float *o = j->out + (t * H + h) * D;
                for (int64_t d = 0; d < D; d++) o[d] = acc[g * D + d] * inv;
                continue;
            }
            float *part = j->parts + ((t * H + h) * n_split + c) * (D + 2);
            part[D + 1] = 0.0f;
            if (empty) continue;
            memcpy(part, acc + g * D, sizeof(float) * D);
            part[D] = M[g];
            part[D + 1] = Ssum[g];
        }
    }
}

/* n_split > 1: each (row, head)'s chunks merged in chunk order, in float32 */
static void merge_chunks(const attention_job *j, int64_t T) {
    const int64_t D = j->D, n_split = j->n_split;
    for (int64_t th = 0; th < T * j->H; th++) {
        float *acc = j->out + th * D, M_final = -INFINITY, S_final = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t c = 0; c < n_split; c++) {
            const float *part = j->parts + (th * n_split + c) * (D + 2), M = part[D], Ssum = part[D + 1];
            if (Ssum == 0.0f) continue;
            const float M_new = fmaxf(M_final, M);
            const float scale_old = expf(M_final - M_new), scale_new = expf(M - M_new);
            for (int64_t d = 0; d < D; d++) acc[d] = fmaf(acc[d], scale_old, part[d] * scale_new);
            S_final = fmaf(S_final, scale_old, Ssum * scale_new);
            M_final = M_new;
        }
        const float inv = S_final == 0.0f ? 0.0f : 1.0f / S_final;
        for (int64_t d = 0; d < D; d++) acc[d] = S_final == 0.0f ? acc[d] : acc[d] * inv;
    }
}

/* Queries q [T, H, D] (already rounded the way the K cache type asks), keys/values [S, Hkv, D] stored as
 * f16 (kv_f16 = 1) or f32. Online softmax over keys in order; masked keys (k_pos > q_pos, or outside the
 * window) are skipped. With v_acc_f16 the value accumulator is rounded to f16 after every update.
 * n_split > 1 (single-query decode over a long cache, as llama.cpp splits it across its threads): the
 * cells [0, n_cells) are cut into n_split equal chunks, each its own task, whose partial results are merged in
 * float32 in chunk order. */
int mtp_attention(const float *q, const void *kp, const void *vp, int kv_f16, const int64_t *q_pos, const int64_t *k_pos,
                  int64_t T, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale, int64_t window, int v_acc_f16,
                  int64_t n_cells, int64_t n_split, float *out, int n_threads) {
    if (n_split < 1) n_split = 1;
    float *parts = n_split > 1 ? malloc(sizeof(float) * T * H * n_split * (D + 2)) : NULL;
    if (n_split > 1 && !parts) return 2;
    attention_job job = {q, kp, vp, kv_f16, v_acc_f16, q_pos, k_pos, S, H, Hkv, D, window, n_cells, n_split, scale,
                         out, parts, 0};
    /* one row costs about S * D * 4 flops: below ~64K of them, waking the pool costs more */
    const int threads = T * H * S * D >= 65536 ? n_threads : 1;
    const int64_t items = T * Hkv * n_split;
    /* one item a claim: a decode step has few (SmolLM2's 3 KV heads x 2 chunks: grains of two left a thread a third
     * of the step idle), and each is a whole row's keys, far more than a claim costs */
    mtp_parallel_for(items, 1, threads, attention_rows, &job);
    if (n_split > 1 && !job.failed) merge_chunks(&job, T);
    free(parts);
    return job.failed ? 2 : 0;
}

/* ---- attention, tiled (64 or more query rows, f16/f32 K and V) ---------------------------------- */

#define KV_TILE 64

/* llama.cpp's tiled flash attention: keys in tiles of 64; a score is a sequential fused dot product over
 * the head dim; per tile the running max is updated once, the probabilities are expf_arm(s - max) summed
 * eight at a time ((0+4)+(2+6)) + ((1+5)+(3+7)) into a double, and the value accumulator gets one fused
 * multiply-add per key, keys in order. Rows are independent; for speed a unit of work is a block of Q_BLOCK query
 * positions of every query head reading one KV head, which share each tile: K transposed to float once (eight keys'
 * dot products then run side by side in vector lanes, each lane summing its own key's products in order, so every
 * score is the same number) and V converted to float once. A query's values are summed 64 dims at a time in
 * registers, each dim still over the keys in order. Tiles no query of the unit can see are skipped (a skipped tile
 * changes nothing: its scores are all -inf). The twin: ops/attention.py attention_tiled_reference. */
#define Q_BLOCK 16

#ifdef MTP_AVX2
/* r[i] lane l <- r[l] lane i */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
#endif

/* kt [D, KV_TILE] <- the tile's keys (from key ic, zero past S), transposed to float */
static void load_k_tile(float *kt, const void *kp, int kv_f16, int64_t ic, int64_t S, int64_t Hkv, int64_t hk, int64_t D) {
    int64_t d0 = 0;
#ifdef MTP_AVX2
    for (; d0 + 8 <= D; d0 += 8) /* 8 keys x 8 dims at a time, transposed in registers */
        for (int jj = 0; jj < KV_TILE; jj += 8) {
            __m256 r[8];
            for (int l = 0; l < 8; l++) {
                const int64_t s = ic + jj + l, at = (s * Hkv + hk) * D + d0;
                r[l] = s >= S ? _mm256_setzero_ps()
                       : kv_f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const half *)kp + at)))
                                : _mm256_loadu_ps((const float *)kp + at);
            }
            transpose8(r);
            for (int l = 0; l < 8; l++) _mm256_storeu_ps(kt + (d0 + l) * KV_TILE + jj, r[l]);
        }
#endif
    if (d0 == D) return;
    for (int jj = 0; jj < KV_TILE; jj++) {
        const int64_t s = ic + jj;
        for (int64_t d = d0; d < D; d++)
            kt[d * KV_TILE + jj] = s >= S ? 0.0f
                                   : kv_f16 ? h2f(((const half *)kp)[(s * Hkv + hk) * D + d])
                                            : ((const float *)kp)[(s * Hkv + hk) * D + d];
    }
}

/* vt [KV_TILE, D] <- the tile's values as float (rows past S left as they are: their probability is 0) */
static void load_v_tile(float *vt, const void *vp, int kv_f16, int64_t ic, int64_t S, int64_t Hkv, int64_t hk, int64_t D) {
    for (int64_t s = ic; s < ic + KV_TILE && s < S; s++) {
        float *row = vt + (s - ic) * D;
        if (!kv_f16) {
            memcpy(row, (const float *)vp + (s * Hkv + hk) * D, sizeof(float) * D);
            continue;
        }
        f16_to_float(row, (const half *)vp + (s * Hkv + hk) * D, D);
    }
}

/* acc[0..8 NV) += p[j] v[j] over the tile's keys in order (those with p[j] = 0 skipped: fma(v, 0, acc) == acc) */
#ifdef MTP_AVX2
#define ACC_KEYS(NV)                                                                                                   \
    do {                                                                                                               \
        __m256 a[NV];                                                                                                  \
        for (int v = 0; v < NV; v++) a[v] = _mm256_loadu_ps(acc + 8 * v);                                              \
        for (int j = 0; j < n_keys; j++) {                                                                             \
            if (p[j] == 0.0f) continue;                                                                                \
            const __m256 pj = _mm256_set1_ps(p[j]);                                                                    \
            for (int v = 0; v < NV; v++) a[v] = _mm256_fmadd_ps(_mm256_loadu_ps(vt + j * D + 8 * v), pj, a[v]);        \
        }                                                                                                              \
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(acc + 8 * v, a[v]);                                              \
    } while (0)
#endif

static void accumulate_values(float *acc, const float *p, const float *vt, int n_keys, int64_t D) {
    int64_t d = 0;
#ifdef MTP_AVX2
    for (; d + 64 <= D; d += 64, acc += 64, vt += 64) ACC_KEYS(8);
    for (; d + 8 <= D; d += 8, acc += 8, vt += 8) ACC_KEYS(1);
#endif
    for (; d < D; d++, acc++, vt++)
        for (int j = 0; j < n_keys; j++)
            if (p[j] != 0.0f) acc[0] = fmaf(vt[j * D], p[j], acc[0]);
}

/* kq[j] <- kq[j] * scale, or -inf for a key the row does not see; returns the largest (exact in any order). With
 * all_visible (a whole tile, every key visible to the row) no key is looked at, eight lanes at a time. */
static float scaled_scores(float *kq, const int64_t *k_pos, int64_t qpos, int64_t ic, int64_t S, float scale,
                           int64_t window, int all_visible) {
    float tile_max = -INFINITY;
#ifdef MTP_AVX2
    if (all_visible) {
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < KV_TILE; j += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(kq + j), _mm256_set1_ps(scale));
            _mm256_storeu_ps(kq + j, v);
            mx = _mm256_max_ps(mx, v);
        }
        float m8[8];
        _mm256_storeu_ps(m8, mx);
        for (int l = 0; l < 8; l++) tile_max = m8[l] > tile_max ? m8[l] : tile_max;
        return tile_max;
    }
#endif
    for (int j = 0; j < KV_TILE; j++) {
        const int64_t s = ic + j;
        const int64_t delta = s < S ? qpos - k_pos[s] : -1;
        if (delta < 0 || (window > 0 && delta >= window)) {
            kq[j] = -INFINITY;
            continue;
        }
        kq[j] *= scale;
        tile_max = kq[j] > tile_max ? kq[j] : tile_max;
    }
    return tile_max;
}

/* One query row against the tile at key ic (all_visible: every key of a whole tile visible to it). */
static void attend_tile_row(const float *qv, const float *kt, const float *vt, int64_t qpos, const int64_t *k_pos,
                            int64_t ic, int64_t S, int64_t D, float scale, int64_t window, int all_visible, float *acc,
                            float *M, float *Ssum) {
    float kq[KV_TILE];
#ifdef MTP_AVX2
    __m256 a[KV_TILE / 8];
    for (int v = 0; v < KV_TILE / 8; v++) a[v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 qd = _mm256_set1_ps(qv[d]);
        for (int v = 0; v < KV_TILE / 8; v++) a[v] = _mm256_fmadd_ps(_mm256_loadu_ps(kt + d * KV_TILE + 8 * v), qd, a[v]);
    }
    for (int v = 0; v < KV_TILE / 8; v++) _mm256_storeu_ps(kq + 8 * v, a[v]);
#else
    for (int j = 0; j < KV_TILE; j++) kq[j] = 0.0f;
    for (int64_t d = 0; d < D; d++)
        for (int j = 0; j < KV_TILE; j++) kq[j] = fmaf(kt[d * KV_TILE + j], qv[d], kq[j]);
#endif
    const float tile_max = scaled_scores(kq, k_pos, qpos, ic, S, scale, window, all_visible);
    if (tile_max == -INFINITY) return;
    const float Mnew = fmaxf(*M, tile_max);
    if (Mnew > *M) {
        const float ms = expf(*M - Mnew);
        for (int64_t d = 0; d < D; d++) acc[d] *= ms;
        *Ssum *= ms;
    }
    *M = Mnew;
    double tile_sum = 0.0;
    for (int j = 0; j < KV_TILE; j += 8) {
#ifdef MTP_AVX2
        const __m256 e = expf_arm8(_mm256_sub_ps(_mm256_loadu_ps(kq + j), _mm256_set1_ps(Mnew)));
        _mm256_storeu_ps(kq + j, e);
        tile_sum += (double)hsum8_v(e);
#else
        float e[8];
        for (int l = 0; l < 8; l++) e[l] = kq[j + l] = expf_arm(kq[j + l] - Mnew);
        tile_sum += (double)hsum8(e);
#endif
    }
    *Ssum = (float)((double)*Ssum + tile_sum);
    accumulate_values(acc, kq, vt, S - ic < KV_TILE ? (int)(S - ic) : KV_TILE, D);
}

typedef struct {
    const float *q;
    const void *kp, *vp;
    int kv_f16;
    const int64_t *q_pos, *k_pos;
    int64_t T, S, H, Hkv, D, window, n_blocks;
    float scale;
    float *out;
    _Atomic int failed;
} tiled_job;

/* Whether any key of the tile is visible to a query at a position in [min_pos, max_pos] */
static int tile_visible(const int64_t *k_pos, int64_t ic, int64_t S, int64_t min_pos, int64_t max_pos, int64_t window) {
    for (int64_t s = ic; s < ic + KV_TILE && s < S; s++)
        if (k_pos[s] <= max_pos && (window <= 0 || k_pos[s] > min_pos - window)) return 1;
    return 0;
}

/* (KV head, block of Q_BLOCK query positions) pairs [begin, end): every query head of the KV head's group */
static void attention_blocks(void *ctx, int64_t begin, int64_t end) {
    tiled_job *j = ctx;
    const int64_t D = j->D, T = j->T, S = j->S, H = j->H, Hkv = j->Hkv, group = H / Hkv, n_blocks = j->n_blocks;
    const int64_t rows = group * Q_BLOCK;
    float *kt = thread_floats(2 * D * KV_TILE + rows * (D + 2));
    if (!kt) {
        j->failed = 1;
        return;
    }
    float *vt = kt + D * KV_TILE, *acc = vt + D * KV_TILE, *M = acc + rows * D, *Ssum = M + rows;
    for (int64_t w = begin; w < end; w++) {
        const int64_t hk = w / n_blocks, t0 = (w % n_blocks) * Q_BLOCK;
        const int64_t nq = T - t0 < Q_BLOCK ? T - t0 : Q_BLOCK;
        int64_t min_pos = j->q_pos[t0], max_pos = j->q_pos[t0];
        for (int64_t i = 0; i < nq; i++) {
            max_pos = j->q_pos[t0 + i] > max_pos ? j->q_pos[t0 + i] : max_pos;
            min_pos = j->q_pos[t0 + i] < min_pos ? j->q_pos[t0 + i] : min_pos;
        }
        for (int64_t r = 0; r < rows; r++) {
            M[r] = -INFINITY;
            Ssum[r] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * rows * D);
        for (int64_t ic = 0; ic < S; ic += KV_TILE) {
            if (!tile_visible(j->k_pos, ic, S, min_pos, max_pos, j->window)) continue;
            load_k_tile(kt, j->kp, j->kv_f16, ic, S, Hkv, hk, D);
            load_v_tile(vt, j->vp, j->kv_f16, ic, S, Hkv, hk, D);
            int64_t k_min = INT64_MAX, k_max = INT64_MIN; /* the tile's key positions, for the rows that see them all */
            for (int64_t s = ic; s < ic + KV_TILE && s < S; s++) {
                k_min = j->k_pos[s] < k_min ? j->k_pos[s] : k_min;
                k_max = j->k_pos[s] > k_max ? j->k_pos[s] : k_max;
            }
            for (int64_t i = 0; i < nq; i++) {
                const int64_t qpos = j->q_pos[t0 + i];
                const int all_visible = ic + KV_TILE <= S && k_max <= qpos && (j->window <= 0 || qpos - k_min < j->window);
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = hk * group + g, r = g * Q_BLOCK + i;
                    attend_tile_row(j->q + ((t0 + i) * H + h) * D, kt, vt, qpos, j->k_pos, ic, S, D, j->scale,
                                    j->window, all_visible, acc + r * D, &M[r], &Ssum[r]);
                }
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < nq; i++) {
                const int64_t r = g * Q_BLOCK + i;
                const float inv = Ssum[r] == 0.0f ? 0.0f : 1.0f / Ssum[r];
                float *o = j->out + ((t0 + i) * H + hk * group + g) * D;
                for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
            }
    }
}

int mtp_attention_tiled(const float *q, const void *kp, const void *vp, int kv_f16, const int64_t *q_pos,
                        const int64_t *k_pos, int64_t T, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale,
                        int64_t window, float *out, int n_threads) {
    const int64_t n_blocks = (T + Q_BLOCK - 1) / Q_BLOCK;
    tiled_job job = {q, kp, vp, kv_f16, q_pos, k_pos, T, S, H, Hkv, D, window, n_blocks, scale, out, 0};
    mtp_parallel_for(Hkv * n_blocks, 1, n_threads, attention_blocks, &job);
    return job.failed ? 2 : 0;
}
