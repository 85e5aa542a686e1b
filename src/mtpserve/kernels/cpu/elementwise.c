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

/* Elementwise and row-wise calls this large or larger go to the pool (a prompt's activations); a decode row stays on
 * the calling thread, where waking the pool costs more than the loop. */
#define ELEMENTWISE_PARALLEL_MIN 65536
#define ELEMENTWISE_GRAIN 8192

typedef struct {
    const float *x, *g;
    float *y;
} glu_job;

static void swiglu_items(void *ctx, int64_t begin, int64_t end) {
    const glu_job *j = ctx;
    for (int64_t i = begin; i < end; i++) {
        const float e = expf_arm(0.0f - j->x[i]);
        j->y[i] = (j->x[i] / (1.0f + e)) * j->g[i];
    }
}

static int elementwise_threads(int64_t work, int n_threads) { return work >= ELEMENTWISE_PARALLEL_MIN ? n_threads : 1; }

/* y = silu(x) * g with silu(x) = x / (1 + exp(-x)); n values (y may alias x). */
int mtp_swiglu(const float *x, const float *g, float *y, int64_t n, int n_threads) {
    glu_job job = {x, g, y};
    mtp_parallel_for(n, ELEMENTWISE_GRAIN, elementwise_threads(n, n_threads), swiglu_items, &job);
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

static void geglu_items(void *ctx, int64_t begin, int64_t end) {
    const glu_job *j = ctx;
    for (int64_t i = begin; i < end; i++) {
        const float x = j->x[i];
        if (x <= -10.0f) j->y[i] = 0.0f;
        else if (x >= 10.0f) j->y[i] = x * j->g[i];
        else j->y[i] = h2f(gelu_table[f2h(x)]) * j->g[i];
    }
}

int mtp_geglu(const float *x, const float *g, float *y, int64_t n, int n_threads) {
    if (!gelu_table_ready) fill_gelu_table(); /* before the pool: the workers only read it */
    glu_job job = {x, g, y};
    mtp_parallel_for(n, ELEMENTWISE_GRAIN, elementwise_threads(n, n_threads), geglu_items, &job);
    return 0;
}

/* y = x * sigmoid(g), the sigmoid as llama.cpp's CPU computes it (ggml_vec_sigmoid_f32): 1 / (1 + expf(-g)). */
int mtp_sigmoid_gate(const float *x, const float *g, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * (1.0f / (1.0f + expf(-g[i])));
    return 0;
}

/* ---- RMSNorm ------------------------------------------------------------------------------------------ */

/* y = x * (1 / sqrt(mean(x^2) + eps)) [* w] per row of n, as llama.cpp: squares in float summed in
 * double in order, the mean rounded to float, one division for the scale, then the weight product. Each row's sum
 * is one chain of dependent double additions (its order is the result), so rows go four at a time, four chains in
 * flight, and over the pool for a prompt's rows; y may alias x (a row's sum is taken before it is written). */
typedef struct {
    const float *x, *w;
    float *y;
    int64_t n;
    float eps;
} norm_job;

#define NORM_ROWS 4

/* a row's scale from its sum of squares, then y = x * scale [* w] */
static void norm_store(const norm_job *j, const float *xr, double sum, float *yr) {
    const float mean = (float)(sum / (double)j->n);
    const float scale = 1.0f / sqrtf(mean + j->eps);
    if (j->w)
        for (int64_t i = 0; i < j->n; i++) yr[i] = (xr[i] * scale) * j->w[i];
    else
        for (int64_t i = 0; i < j->n; i++) yr[i] = xr[i] * scale;
}

static void norm_rows(void *ctx, int64_t begin, int64_t end) {
    const norm_job *j = ctx;
    const int64_t n = j->n;
    int64_t r = begin;
    for (; r + NORM_ROWS <= end; r += NORM_ROWS) {
        const float *xr = j->x + r * n;
        double sum[NORM_ROWS] = {0.0, 0.0, 0.0, 0.0};
        for (int64_t i = 0; i < n; i++)
            for (int k = 0; k < NORM_ROWS; k++) sum[k] += (double)(xr[k * n + i] * xr[k * n + i]);
        for (int k = 0; k < NORM_ROWS; k++) norm_store(j, xr + k * n, sum[k], j->y + (r + k) * n);
    }
    for (; r < end; r++) { /* the rest (a decode's one row) alone: one chain */
        const float *xr = j->x + r * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        norm_store(j, xr, sum, j->y + r * n);
    }
}

int mtp_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, int n_threads) {
    norm_job job = {x, w, y, n, eps};
    const int threads = elementwise_threads(rows * n, n_threads);
    mtp_parallel_for(rows, chunk_grain(rows, threads, 2, NORM_ROWS) / NORM_ROWS * NORM_ROWS, threads, norm_rows, &job);
    return 0;
}
