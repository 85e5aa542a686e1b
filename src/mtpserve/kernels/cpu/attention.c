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

typedef struct {
    const float *q;
    const void *kp, *vp;
    int kv_f16, v_acc_f16;
    const int64_t *q_pos, *k_pos;
    int64_t S, H, Hkv, D, window, n_cells, n_split;
    float scale;
    float *out;
    _Atomic int failed;
} attention_job;

/* (query row, head) pairs [begin, end) */
static void attention_rows(void *ctx, int64_t begin, int64_t end) {
    attention_job *j = ctx;
    const int64_t D = j->D, H = j->H, S = j->S, group = H / j->Hkv, n_split = j->n_split;
    float *acc = thread_floats(3 * D);
    if (!acc) {
        j->failed = 1;
        return;
    }
    float *part = acc + D;
    half *qh = (half *)(part + D);
    for (int64_t th = begin; th < end; th++) {
        const int64_t t = th / H, h = th % H, hk = h / group;
        const float *qv = j->q + (t * H + h) * D;
        float *o = j->out + (t * H + h) * D;
        for (int64_t d = 0; d < D; d++) qh[d] = f2h(qv[d]);
        if (n_split <= 1) {
            float M, Ssum;
            attend_row(qv, qh, j->kp, j->vp, j->kv_f16, j->q_pos[t], j->k_pos, 0, S, j->Hkv, hk, D, j->scale, j->window,
                       j->v_acc_f16, acc, &M, &Ssum);
            const float inv = Ssum == 0.0f ? 0.0f : 1.0f / Ssum;
            for (int64_t d = 0; d < D; d++) o[d] = acc[d] * inv;
            continue;
        }
        const int64_t chunk = (j->n_cells + n_split - 1) / n_split;
        float M_final = -INFINITY, S_final = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t c = 0; c < n_split; c++) {
            const int64_t s0 = c * chunk, s1 = (c + 1) * chunk < S ? (c + 1) * chunk : S;
            if (s0 >= j->n_cells || s0 >= S) continue;
            float M, Ssum;
            attend_row(qv, qh, j->kp, j->vp, j->kv_f16, j->q_pos[t], j->k_pos, s0, s1, j->Hkv, hk, D, j->scale, j->window,
                       j->v_acc_f16, part, &M, &Ssum);
            if (Ssum == 0.0f) continue;
            const float M_new = fmaxf(M_final, M);
            const float scale_old = expf(M_final - M_new), scale_new = expf(M - M_new);
            for (int64_t d = 0; d < D; d++) acc[d] = fmaf(acc[d], scale_old, part[d] * scale_new);
            S_final = fmaf(S_final, scale_old, Ssum * scale_new);
            M_final = M_new;
        }
        const float inv = S_final == 0.0f ? 0.0f : 1.0f / S_final;
        for (int64_t d = 0; d < D; d++) o[d] = S_final == 0.0f ? acc[d] : acc[d] * inv;
    }
}

/* Queries q [T, H, D] (already rounded the way the K cache type asks), keys/values [S, Hkv, D] stored as
 * f16 (kv_f16 = 1) or f32. Online softmax over keys in order; masked keys (k_pos > q_pos, or outside the
 * window) are skipped. With v_acc_f16 the value accumulator is rounded to f16 after every update.
 * n_split > 1 (single-query decode over a long cache, as llama.cpp splits it across its threads): the
 * cells [0, n_cells) are cut into n_split equal chunks whose partial results are merged in float32. */
int mtp_attention(const float *q, const void *kp, const void *vp, int kv_f16, const int64_t *q_pos, const int64_t *k_pos,
                  int64_t T, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale, int64_t window, int v_acc_f16,
                  int64_t n_cells, int64_t n_split, float *out, int n_threads) {
    attention_job job = {q, kp, vp, kv_f16, v_acc_f16, q_pos, k_pos, S, H, Hkv, D, window, n_cells, n_split, scale, out, 0};
    /* one row costs about S * D * 4 flops: below ~64K of them, waking the pool costs more */
    const int threads = T * H * S * D >= 65536 ? n_threads : 1;
    mtp_parallel_for(T * H, chunk_grain(T * H, threads, 2, 1), threads, attention_rows, &job);
    return job.failed ? 2 : 0;
}

/* ---- attention, tiled (64 or more query rows, f16/f32 K and V) ---------------------------------- */

#define KV_TILE 64

/* llama.cpp's tiled flash attention: keys in tiles of 64; a score is a sequential fused dot product over
 * the head dim; per tile the running max is updated once, the probabilities are expf_arm(s - max) summed
 * eight at a time ((0+4)+(2+6)) + ((1+5)+(3+7)) into a double, and the value accumulator gets one fused
 * multiply-add per key. Rows are independent; for speed a block of Q_BLOCK query rows of one head shares
 * each K tile, transposed to float once, and eight keys' dot products run side by side in vector lanes
 * (each lane still sums its own key's products in order, so every score is the same number). */
#define Q_BLOCK 16

static void attend_tile_row(const float *qv, const float *kt, const void *vp, int kv_f16, int64_t qpos, const int64_t *k_pos,
                            int64_t ic, int64_t S, int64_t Hkv, int64_t hk, int64_t D, float scale, int64_t window,
                            float *acc, float *M, float *Ssum) {
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
    float tile_max = -INFINITY;
    for (int j = 0; j < KV_TILE; j++) {
        const int64_t s = ic + j;
        const int64_t delta = s < S ? qpos - k_pos[s] : -1;
        if (delta < 0 || (window > 0 && delta >= window)) { kq[j] = -INFINITY; continue; }
        kq[j] *= scale;
        tile_max = kq[j] > tile_max ? kq[j] : tile_max;
    }
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
        float e[8];
        for (int l = 0; l < 8; l++) e[l] = kq[j + l] = expf_arm(kq[j + l] - Mnew);
        tile_sum += (double)hsum8(e);
    }
    *Ssum = (float)((double)*Ssum + tile_sum);
    for (int j = 0; j < KV_TILE && ic + j < S; j++) {
        if (kq[j] == 0.0f) continue; /* fma(v, 0, acc) == acc */
        if (kv_f16) {
            const half *v = (const half *)vp + ((ic + j) * Hkv + hk) * D;
            int64_t d = 0;
#ifdef MTP_AVX2
            const __m256 p = _mm256_set1_ps(kq[j]);
            for (; d + 8 <= D; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + d))), p, _mm256_loadu_ps(acc + d)));
#endif
            for (; d < D; d++) acc[d] = fmaf(h2f(v[d]), kq[j], acc[d]);
        } else {
            const float *v = (const float *)vp + ((ic + j) * Hkv + hk) * D;
            for (int64_t d = 0; d < D; d++) acc[d] = fmaf(v[d], kq[j], acc[d]);
        }
    }
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

/* (head, block of Q_BLOCK query rows) pairs [begin, end) */
static void attention_blocks(void *ctx, int64_t begin, int64_t end) {
    tiled_job *j = ctx;
    const int64_t D = j->D, T = j->T, S = j->S, H = j->H, Hkv = j->Hkv, group = H / Hkv, n_blocks = j->n_blocks;
    float *kt = thread_floats(D * KV_TILE + Q_BLOCK * D);
    if (!kt) {
        j->failed = 1;
        return;
    }
    float *acc = kt + D * KV_TILE;
    for (int64_t w = begin; w < end; w++) {
        const int64_t h = w / n_blocks, t0 = (w % n_blocks) * Q_BLOCK, hk = h / group;
        const int64_t nq = T - t0 < Q_BLOCK ? T - t0 : Q_BLOCK;
        float M[Q_BLOCK], Ssum[Q_BLOCK];
        int64_t max_pos = j->q_pos[t0];
        for (int64_t i = 0; i < nq; i++) {
            M[i] = -INFINITY;
            Ssum[i] = 0.0f;
            max_pos = j->q_pos[t0 + i] > max_pos ? j->q_pos[t0 + i] : max_pos;
        }
        for (int64_t i = 0; i < nq * D; i++) acc[i] = 0.0f;
        for (int64_t ic = 0; ic < S; ic += KV_TILE) {
            int any = 0; /* a tile no query of the block can see changes nothing: skip it */
            for (int jj = 0; jj < KV_TILE && ic + jj < S && !any; jj++) any = j->k_pos[ic + jj] <= max_pos;
            if (!any) continue;
            for (int jj = 0; jj < KV_TILE; jj++) {
                const int64_t s = ic + jj;
                for (int64_t d = 0; d < D; d++)
                    kt[d * KV_TILE + jj] = s >= S ? 0.0f
                                           : j->kv_f16 ? h2f(((const half *)j->kp)[(s * Hkv + hk) * D + d])
                                                       : ((const float *)j->kp)[(s * Hkv + hk) * D + d];
            }
            for (int64_t i = 0; i < nq; i++)
                attend_tile_row(j->q + ((t0 + i) * H + h) * D, kt, j->vp, j->kv_f16, j->q_pos[t0 + i], j->k_pos, ic, S, Hkv, hk,
                                D, j->scale, j->window, acc + i * D, &M[i], &Ssum[i]);
        }
        for (int64_t i = 0; i < nq; i++) {
            const float inv = Ssum[i] == 0.0f ? 0.0f : 1.0f / Ssum[i];
            float *o = j->out + ((t0 + i) * H + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = acc[i * D + d] * inv;
        }
    }
}

int mtp_attention_tiled(const float *q, const void *kp, const void *vp, int kv_f16, const int64_t *q_pos,
                        const int64_t *k_pos, int64_t T, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale,
                        int64_t window, float *out, int n_threads) {
    const int64_t n_blocks = (T + Q_BLOCK - 1) / Q_BLOCK;
    tiled_job job = {q, kp, vp, kv_f16, q_pos, k_pos, T, S, H, Hkv, D, window, n_blocks, scale, out, 0};
    mtp_parallel_for(H * n_blocks, 1, n_threads, attention_blocks, &job);
    return job.failed ? 2 : 0;
}
