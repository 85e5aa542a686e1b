/*
 * Gated DeltaNet, token by token (decode and draft verification), fused: causal conv1d update, SiLU,
 * L2-normalised q/k, the gated delta rule, and the gated RMSNorm of the output. The PyTorch twins are
 * ops/conv.py, ops/norm.py and ops/gated_delta.py (gated_delta_rule_recurrent).
 */

#include "common.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* mixed [T, C] raw projections (C = 2 Hk K + Hv V: q | k | v), conv_state [C, W-1] and conv_w [C, W];
 * z [T, Hv, V] gate; beta [T, Hv] (already sigmoid), g [T, Hv] (log decay); ssm [Hv, K, V] state;
 * norm_w [V]. V head h reads q/k head h % Hk. Writes y [T, Hv * V]; updates conv_state and ssm in place;
 * with `states` [T, Hv, K, V] and `conv_states` [T, C, W-1] also keeps both after every token (draft
 * verification rolls back to any of them). */
int mtp_gdn_step(const float *mixed, float *conv_state, const float *conv_w, const float *z, const float *beta,
                 const float *g, float *ssm, const float *norm_w, float *y, float *states, float *conv_states, int64_t T,
                 int64_t Hk, int64_t Hv, int64_t K, int64_t V, int64_t W, float eps) {
    const int64_t C = 2 * Hk * K + Hv * V;
    float *u = malloc(sizeof(float) * C);
    float *o = malloc(sizeof(float) * V);
    if (!u || !o) { free(u); free(o); return 2; }
    const float q_scale = 1.0f / sqrtf((float)K);
    for (int64_t t = 0; t < T; t++) {
        const float *xt = mixed + t * C;
        /* conv over [state (W-1 columns), x_t]; then shift the state left by one */
        for (int64_t c = 0; c < C; c++) {
            float *st = conv_state + c * (W - 1);
            const float *wc = conv_w + c * W;
            float acc = 0.0f;
            for (int64_t i = 0; i < W - 1; i++) acc = fmaf(wc[i], st[i], acc);
            acc = fmaf(wc[W - 1], xt[c], acc);
            for (int64_t i = 0; i + 1 < W - 1; i++) st[i] = st[i + 1];
            if (W > 1) st[W - 2] = xt[c];
            u[c] = silu(acc);
        }
        if (conv_states) memcpy(conv_states + t * C * (W - 1), conv_state, sizeof(float) * C * (W - 1));
        /* L2 norm of each q and k head: x / sqrt(sum x^2 + eps) */
        for (int64_t h = 0; h < 2 * Hk; h++) {
            float *v = u + h * K;
            float ss = 0.0f;
            for (int64_t i = 0; i < K; i++) ss = fmaf(v[i], v[i], ss);
            const float inv = 1.0f / sqrtf(ss + eps);
            for (int64_t i = 0; i < K; i++) v[i] *= inv;
        }
        for (int64_t h = 0; h < Hv; h++) {
            const float *q = u + (h % Hk) * K, *k = u + Hk * K + (h % Hk) * K, *v = u + 2 * Hk * K + h * V;
            float *S = ssm + h * K * V; /* S[i][j]: key index i, value index j */
            const float decay = expf(g[t * Hv + h]), b = beta[t * Hv + h];
            for (int64_t i = 0; i < K * V; i++) S[i] *= decay;
            for (int64_t j = 0; j < V; j++) { /* delta_j = b (v_j - sum_i S[i][j] k_i) */
                float kv = 0.0f;
                for (int64_t i = 0; i < K; i++) kv = fmaf(S[i * V + j], k[i], kv);
                o[j] = b * (v[j] - kv);
            }
            for (int64_t i = 0; i < K; i++)
                for (int64_t j = 0; j < V; j++) S[i * V + j] = fmaf(k[i], o[j], S[i * V + j]);
            for (int64_t j = 0; j < V; j++) { /* o_j = sum_i S[i][j] q_i / sqrt(K) */
                float acc = 0.0f;
                for (int64_t i = 0; i < K; i++) acc = fmaf(S[i * V + j], q[i], acc);
                o[j] = acc * q_scale;
            }
            /* gated RMSNorm: rms_norm(o) * w * silu(z) */
            float ss = 0.0f;
            for (int64_t j = 0; j < V; j++) ss = fmaf(o[j], o[j], ss);
            const float scale = 1.0f / sqrtf(ss / (float)V + eps);
            const float *zh = z + (t * Hv + h) * V;
            float *yh = y + (t * Hv + h) * V;
            for (int64_t j = 0; j < V; j++) yh[j] = (o[j] * scale) * norm_w[j] * silu(zh[j]);
            if (states) memcpy(states + ((t * Hv + h) * K) * V, S, sizeof(float) * K * V);
        }
    }
    free(u);
    free(o);
    return 0;
}
