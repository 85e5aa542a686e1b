/*
 * Whole sub-blocks in one call, for decode, where each separate call from Python costs more than its
 * arithmetic on small models. Each is the composition of the library's own entry points, so it computes
 * exactly what the separate calls compute (the PyTorch twins: ops/activations.py swiglu_ffn_reference,
 * ops/gated_delta.py gated_delta_net_decode_reference).
 */

#include "common.h"

int mtp_matmul_many(int n_w, const int *types, const uint8_t *const *W, const int64_t *rows, int64_t k,
                    const float *x, int64_t m, int64_t seq_len, float *const *y, int n_threads);
int mtp_matmul(int type, const uint8_t *W, int64_t n_rows, int64_t k, const float *x, int64_t m, int64_t seq_len,
               float *y, int n_threads);
int mtp_swiglu(const float *x, const float *g, float *y, int64_t n);
int mtp_gdn_step(const float *mixed, float *conv_state, const float *conv_w, const float *z, const float *beta,
                 const float *g, float *ssm, const float *norm_w, float *y, float *states, float *conv_states, int64_t T,
                 int64_t Hk, int64_t Hv, int64_t K, int64_t V, int64_t W, float eps);

/* out [T, E] = down(silu(gate(x)) * up(x)) for x [T, E] (sequences of seq_len rows, see mtp_matmul);
 * gate/up [F, E] and down [E, F] GGUF matrices. */
int mtp_swiglu_ffn(const float *x, int64_t T, int64_t seq_len, int64_t E, int t_gate, const uint8_t *w_gate, int t_up,
                   const uint8_t *w_up, int64_t F, int t_down, const uint8_t *w_down, float *out, int n_threads) {
    float *gate = malloc(sizeof(float) * T * F), *up = malloc(sizeof(float) * T * F);
    int rc = 2;
    if (gate && up) {
        const int types[2] = {t_gate, t_up};
        const uint8_t *W[2] = {w_gate, w_up};
        const int64_t rows[2] = {F, F};
        float *y[2] = {gate, up};
        rc = mtp_matmul_many(2, types, W, rows, E, x, T, seq_len, y, n_threads);
        if (rc == 0) rc = mtp_swiglu(gate, up, gate, T * F);
        if (rc == 0) rc = mtp_matmul(t_down, w_down, E, F, gate, T, seq_len, out, n_threads);
    }
    free(gate);
    free(up);
    return rc;
}

/* softplus as torch computes it (threshold 20): x above it is returned as is */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Gated DeltaNet mixers of n_seq = T / seq_len sequences of seq_len tokens each, from the normed input
 * h [T, E] to the output [T, E]: projections for all rows at once (types/W: qkv [C, E], z [Hv V, E],
 * beta [Hv, E], alpha [Hv, E]), beta = sigmoid, g = a * softplus(alpha + dt_bias), then per sequence
 * mtp_gdn_step on its own conv_states[s] / ssms[s] (updated in place; with ssm_steps / conv_steps, the
 * states after every token are kept too), and the output projection w_out [E, Hv V]. */
int mtp_gdn_mixer(const float *h, int64_t T, int64_t seq_len, int64_t E, const int *types, const uint8_t *const *W,
                  const float *dt_bias, const float *a, float *const *conv_states, const float *conv_w, float *const *ssms,
                  const float *norm_w, int64_t Hk, int64_t Hv, int64_t K, int64_t V, int64_t n_conv, float eps, int t_out,
                  const uint8_t *w_out, float *out, float *const *ssm_steps, float *const *conv_steps, int n_threads) {
    if (seq_len <= 0 || T % seq_len) return 1;
    const int64_t C = 2 * Hk * K + Hv * V;
    float *buf = malloc(sizeof(float) * T * (C + Hv * V + 2 * Hv + Hv * V));
    if (!buf) return 2;
    float *mixed = buf, *z = mixed + T * C, *beta = z + T * Hv * V, *g = beta + T * Hv, *y = g + T * Hv;
    const int64_t rows[4] = {C, Hv * V, Hv, Hv};
    float *outs[4] = {mixed, z, beta, g};
    int rc = mtp_matmul_many(4, types, W, rows, E, h, T, seq_len, outs, n_threads);
    if (rc == 0) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < Hv; j++) {
                beta[t * Hv + j] = 1.0f / (1.0f + expf(-beta[t * Hv + j]));
                g[t * Hv + j] = a[j] * softplus(g[t * Hv + j] + dt_bias[j]);
            }
        for (int64_t s = 0; s < T / seq_len && rc == 0; s++) {
            const int64_t r0 = s * seq_len;
            rc = mtp_gdn_step(mixed + r0 * C, conv_states[s], conv_w, z + r0 * Hv * V, beta + r0 * Hv, g + r0 * Hv, ssms[s],
                              norm_w, y + r0 * Hv * V, ssm_steps ? ssm_steps[s] : NULL, conv_steps ? conv_steps[s] : NULL,
                              seq_len, Hk, Hv, K, V, n_conv, eps);
        }
    }
    if (rc == 0) rc = mtp_matmul(t_out, w_out, E, Hv * V, y, T, seq_len, out, n_threads);
    free(buf);
    return rc;
}
