/*
 * Whole sub-blocks in one call, for decode, where each separate call from Python costs more than its
 * arithmetic on small models. Each is the composition of the library's own entry points, so it computes
 * exactly what the separate calls compute (the PyTorch twins: ops/activations.py swiglu_ffn_reference,
 * ops/gated_delta.py gated_delta_net_decode_reference).
 */

#include "common.h"

int mtp_matmul_many(int n_w, const int *types, const uint8_t *const *W, const int64_t *rows, int64_t k,
                    const float *x, int64_t m, float *const *y, int n_threads);
int mtp_matmul(int type, const uint8_t *W, int64_t n_rows, int64_t k, const float *x, int64_t m, float *y, int n_threads);
int mtp_swiglu(const float *x, const float *g, float *y, int64_t n);
int mtp_gdn_step(const float *mixed, float *conv_state, const float *conv_w, const float *z, const float *beta,
                 const float *g, float *ssm, const float *norm_w, float *y, float *states, int64_t T, int64_t Hk,
                 int64_t Hv, int64_t K, int64_t V, int64_t W, float eps);

/* out [T, E] = down(silu(gate(x)) * up(x)) for x [T, E]; gate/up [F, E] and down [E, F] GGUF matrices. */
int mtp_swiglu_ffn(const float *x, int64_t T, int64_t E, int t_gate, const uint8_t *w_gate, int t_up,
                   const uint8_t *w_up, int64_t F, int t_down, const uint8_t *w_down, float *out, int n_threads) {
    float *gate = malloc(sizeof(float) * T * F), *up = malloc(sizeof(float) * T * F);
    int rc = 2;
    if (gate && up) {
        const int types[2] = {t_gate, t_up};
        const uint8_t *W[2] = {w_gate, w_up};
        const int64_t rows[2] = {F, F};
        float *y[2] = {gate, up};
        rc = mtp_matmul_many(2, types, W, rows, E, x, T, y, n_threads);
        if (rc == 0) rc = mtp_swiglu(gate, up, gate, T * F);
        if (rc == 0) rc = mtp_matmul(t_down, w_down, E, F, gate, T, out, n_threads);
    }
    free(gate);
    free(up);
    return rc;
}

/* softplus as torch computes it (threshold 20): x above it is returned as is */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* A Gated DeltaNet mixer for a few tokens, from the normed input h [T, E] to its output [T, E]:
 * projections (types/W: qkv [C, E], z [Hv V, E], beta [Hv, E], alpha [Hv, E]), beta = sigmoid,
 * g = a * softplus(alpha + dt_bias), then mtp_gdn_step (conv_state, ssm updated in place) and the output
 * projection w_out [E, Hv V]. */
int mtp_gdn_mixer(const float *h, int64_t T, int64_t E, const int *types, const uint8_t *const *W, const float *dt_bias,
                  const float *a, float *conv_state, const float *conv_w, float *ssm, const float *norm_w, int64_t Hk,
                  int64_t Hv, int64_t K, int64_t V, int64_t n_conv, float eps, int t_out, const uint8_t *w_out,
                  float *out, int n_threads) {
    const int64_t C = 2 * Hk * K + Hv * V;
    float *buf = malloc(sizeof(float) * T * (C + Hv * V + 2 * Hv + Hv * V));
    if (!buf) return 2;
    float *mixed = buf, *z = mixed + T * C, *beta = z + T * Hv * V, *g = beta + T * Hv, *y = g + T * Hv;
    const int64_t rows[4] = {C, Hv * V, Hv, Hv};
    float *outs[4] = {mixed, z, beta, g};
    int rc = mtp_matmul_many(4, types, W, rows, E, h, T, outs, n_threads);
    if (rc == 0) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < Hv; j++) {
                beta[t * Hv + j] = 1.0f / (1.0f + expf(-beta[t * Hv + j]));
                g[t * Hv + j] = a[j] * softplus(g[t * Hv + j] + dt_bias[j]);
            }
        rc = mtp_gdn_step(mixed, conv_state, conv_w, z, beta, g, ssm, norm_w, y, NULL, T, Hk, Hv, K, V, n_conv, eps);
    }
    if (rc == 0) rc = mtp_matmul(t_out, w_out, E, Hv * V, y, T, out, n_threads);
    free(buf);
    return rc;
}
