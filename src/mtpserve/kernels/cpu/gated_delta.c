/*
 * Gated DeltaNet, token by token (decode and draft verification), fused: causal conv1d update, SiLU,
 * L2-normalised q/k, the gated delta rule, and the gated RMSNorm of the output. The PyTorch twins are
 * ops/conv.py, ops/norm.py and ops/gated_delta.py (gated_delta_rule_recurrent).
 */

#include "common.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* Causal conv1d update, SiLU and the q/k L2 norms of T tokens: u [T, C] from mixed [T, C]; conv_state [C, W-1]
 * shifted in place (with conv_states [T, C, W-1], kept after every token). */
static void gdn_conv(const float *mixed, float *conv_state, const float *conv_w, float *u, float *conv_states, int64_t T,
                     int64_t C, int64_t Hk, int64_t K, int64_t W, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = mixed + t * C;
        float *ut = u + t * C;
        /* conv over [state (W-1 columns), x_t]; then shift the state left by one */
        for (int64_t c = 0; c < C; c++) {
            float *st = conv_state + c * (W - 1);
            const float *wc = conv_w + c * W;
            float acc = 0.0f;
            for (int64_t i = 0; i < W - 1; i++) acc = fmaf(wc[i], st[i], acc);
            acc = fmaf(wc[W - 1], xt[c], acc);
            for (int64_t i = 0; i + 1 < W - 1; i++) st[i] = st[i + 1];
            if (W > 1) st[W - 2] = xt[c];
            ut[c] = silu(acc);
        }
        if (conv_states) memcpy(conv_states + t * C * (W - 1), conv_state, sizeof(float) * C * (W - 1));
        /* L2 norm of each q and k head: x / sqrt(sum x^2 + eps) */
        for (int64_t h = 0; h < 2 * Hk; h++) {
            float *v = ut + h * K;
            float ss = 0.0f;
            for (int64_t i = 0; i < K; i++) ss = fmaf(v[i], v[i], ss);
            const float inv = 1.0f / sqrtf(ss + eps);
            for (int64_t i = 0; i < K; i++) v[i] *= inv;
        }
    }
}

typedef struct {
    const float *u, *z, *beta, *g, *norm_w;
    float *ssm, *y, *states;
    int64_t T, C, Hk, Hv, K, V;
    float eps;
} gdn_heads_job;

/* V heads [begin, end) over all T tokens: each head's state stays in cache while its tokens pass. */
static void gdn_heads(void *ctx, int64_t begin, int64_t end) {
    const gdn_heads_job *j = ctx;
    const int64_t C = j->C, Hk = j->Hk, Hv = j->Hv, K = j->K, V = j->V;
    const float q_scale = 1.0f / sqrtf((float)K);
    float o[V], kv[V];
    for (int64_t h = begin; h < end; h++) {
        float *S = j->ssm + h * K * V; /* S[i][j]: key index i, value index j */
        for (int64_t t = 0; t < j->T; t++) {
            const float *ut = j->u + t * C;
            const float *q = ut + (h % Hk) * K, *k = ut + Hk * K + (h % Hk) * K, *v = ut + 2 * Hk * K + h * V;
            const float decay = expf(j->g[t * Hv + h]), b = j->beta[t * Hv + h];
            /* Row by row (i outer, j inner: contiguous, vectorized), each sum over i in ascending order. */
            for (int64_t c = 0; c < V; c++) kv[c] = 0.0f;
            for (int64_t i = 0; i < K; i++) { /* decay, then kv_j = sum_i S[i][j] k_i */
                float *Si = S + i * V;
                for (int64_t c = 0; c < V; c++) {
                    Si[c] *= decay;
                    kv[c] = fmaf(Si[c], k[i], kv[c]);
                }
            }
            for (int64_t c = 0; c < V; c++) { /* delta_j = b (v_j - kv_j); o_j accumulates below */
                o[c] = b * (v[c] - kv[c]);
                kv[c] = 0.0f;
            }
            for (int64_t i = 0; i < K; i++) { /* S += k delta^T, then o_j = sum_i S[i][j] q_i / sqrt(K) */
                float *Si = S + i * V;
                for (int64_t c = 0; c < V; c++) {
                    Si[c] = fmaf(k[i], o[c], Si[c]);
                    kv[c] = fmaf(Si[c], q[i], kv[c]);
                }
            }
            for (int64_t c = 0; c < V; c++) o[c] = kv[c] * q_scale;
            /* gated RMSNorm: rms_norm(o) * w * silu(z) */
            float ss = 0.0f;
            for (int64_t c = 0; c < V; c++) ss = fmaf(o[c], o[c], ss);
            const float scale = 1.0f / sqrtf(ss / (float)V + j->eps);
            const float *zh = j->z + (t * Hv + h) * V;
            float *yh = j->y + (t * Hv + h) * V;
            for (int64_t c = 0; c < V; c++) yh[c] = (o[c] * scale) * j->norm_w[c] * silu(zh[c]);
            if (j->states) memcpy(j->states + ((t * Hv + h) * K) * V, S, sizeof(float) * K * V);
        }
    }
}

/* mixed [T, C] raw projections (C = 2 Hk K + Hv V: q | k | v), conv_state [C, W-1] and conv_w [C, W];
 * z [T, Hv, V] gate; beta [T, Hv] (already sigmoid), g [T, Hv] (log decay); ssm [Hv, K, V] state;
 * norm_w [V]. V head h reads q/k head h % Hk. Writes y [T, Hv * V]; updates conv_state and ssm in place;
 * with `states` [T, Hv, K, V] and `conv_states` [T, C, W-1] also keeps both after every token (draft
 * verification rolls back to any of them). The V heads run in parallel (n_threads), each over all T tokens. */
int mtp_gdn_recurrence(const float *mixed, float *conv_state, const float *conv_w, const float *z, const float *beta,
                       const float *g, float *ssm, const float *norm_w, float *y, float *states, float *conv_states,
                       int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V, int64_t W, float eps, int n_threads) {
    const int64_t C = 2 * Hk * K + Hv * V;
    float *u = malloc(sizeof(float) * T * C);
    if (!u) return 2;
    gdn_conv(mixed, conv_state, conv_w, u, conv_states, T, C, Hk, K, W, eps);
    gdn_heads_job job = {u, z, beta, g, norm_w, ssm, y, states, T, C, Hk, Hv, K, V, eps};
    const int threads = Hv * K * V * T >= 65536 ? n_threads : 1; /* waking the pool costs more below */
    mtp_parallel_for(Hv, 1, threads, gdn_heads, &job);
    free(u);
    return 0;
}

/* mtp_gdn_recurrence on one thread (the twin tests' entry point). */
int mtp_gdn_step(const float *mixed, float *conv_state, const float *conv_w, const float *z, const float *beta,
                 const float *g, float *ssm, const float *norm_w, float *y, float *states, float *conv_states, int64_t T,
                 int64_t Hk, int64_t Hv, int64_t K, int64_t V, int64_t W, float eps) {
    return mtp_gdn_recurrence(mixed, conv_state, conv_w, z, beta, g, ssm, norm_w, y, states, conv_states, T, Hk, Hv, K, V,
                              W, eps, 1);
}
