#include "common.h"

/* ---- rotary embeddings ---------------------------------------------------------------------------- */

/* cos/sin [T, n_pairs] of llama.cpp's rope cache: pair i of row t rotates by theta = p * s^i accumulated
 * one float multiplication per pair (s = powf(base, -2/n_rot)), times freq_scale; p is positions[t*4 +
 * stream[i]] for multi-section rope (stream != NULL) else positions[t]. cosf/sinf from libm. */
int mtp_rope_cache(const float *positions, const int32_t *stream, int64_t T, int64_t n_rot, float base,
                   float freq_scale, float *cos_out, float *sin_out) {
    const int64_t n_pairs = n_rot / 2;
    const float theta_scale = powf(base, -2.0f / (float)n_rot);
    for (int64_t t = 0; t < T; t++) {
        float theta[4];
        for (int k = 0; k < 4; k++) theta[k] = stream ? positions[t * 4 + k] : positions[t];
        for (int64_t i = 0; i < n_pairs; i++) {
            const float th = freq_scale * theta[stream ? stream[i] : 0];
            cos_out[t * n_pairs + i] = cosf(th);
            sin_out[t * n_pairs + i] = sinf(th);
            for (int k = 0; k < 4; k++) theta[k] *= theta_scale;
        }
    }
    return 0;
}

/* Rotate the first n_rot dims of x [T, H, D] in place: pairs (i, i + n_rot/2) for NeoX, (2i, 2i+1)
 * otherwise; x0' = x0 cos - x1 sin and x1' = x0 sin + x1 cos, each with one fused multiply-add. */
int mtp_rope_apply(float *x, const float *cos_c, const float *sin_c, int64_t T, int64_t H, int64_t D, int64_t n_rot, int neox) {
    const int64_t n_pairs = n_rot / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            float *r = x + (t * H + h) * D;
            for (int64_t i = 0; i < n_pairs; i++) {
                const float c = cos_c[t * n_pairs + i], s = sin_c[t * n_pairs + i];
                float *a = neox ? r + i : r + 2 * i;
                float *b = neox ? r + i + n_pairs : r + 2 * i + 1;
                const float x0 = *a, x1 = *b;
                *a = fmaf(x0, c, -(x1 * s));
                *b = fmaf(x0, s, x1 * c);
            }
        }
    return 0;
}

/* ---- activations ------------------------------------------------------------------------------------ */

/* y = silu(x) * g with silu(x) = x / (1 + exp(-x)); n values. */
int mtp_swiglu(const float *x, const float *g, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float e = expf_arm(0.0f - x[i]);
        y[i] = (x[i] / (1.0f + e)) * g[i];
    }
    return 0;
}

/* GeGLU as llama.cpp computes it on CPU: GELU (tanh form) looked up in a table indexed by the f16
 * rounding of x (filled once from the float formula), 0 below -10 and identity above 10; times g. */
static half gelu_table[1 << 16];
static int gelu_table_ready = 0;

static void fill_gelu_table(void) {
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f, coef_a = 0.044715f;
    for (int i = 0; i < (1 << 16); i++) {
        const float x = h2f((half)i);
        const float inner = fmaf(coef_a * x, x, 1.0f);
        gelu_table[i] = f2h(0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * x * inner)));
    }
    gelu_table_ready = 1;
}

int mtp_geglu(const float *x, const float *g, float *y, int64_t n) {
    if (!gelu_table_ready) fill_gelu_table();
    for (int64_t i = 0; i < n; i++) {
        if (x[i] <= -10.0f) y[i] = 0.0f;
        else if (x[i] >= 10.0f) y[i] = x[i] * g[i];
        else y[i] = h2f(gelu_table[f2h(x[i])]) * g[i];
    }
    return 0;
}

/* y = x * sigmoid(g), the sigmoid as llama.cpp's CPU computes it (ggml_vec_sigmoid_f32): 1 / (1 + expf(-g)). */
int mtp_sigmoid_gate(const float *x, const float *g, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * (1.0f / (1.0f + expf(-g[i])));
    return 0;
}

/* ---- RMSNorm ------------------------------------------------------------------------------------------ */

/* y = x * (1 / sqrt(mean(x^2) + eps)) [* w] per row of n, as llama.cpp: squares in float summed in
 * double in order, the mean rounded to float, one division for the scale, then the weight product. */
int mtp_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)n);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < n; i++) yr[i] = w ? (xr[i] * scale) * w[i] : xr[i] * scale;
    }
    return 0;
}
