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
int mtp_swiglu(const float *x, const float *g, float *y, int64_t n, int n_threads);
int mtp_gdn_recurrence(const float *mixed, float *conv_state, const float *conv_w, const float *z, const float *beta,
                       const float *g, float *ssm, const float *norm_w, float *y, float *states, float *conv_states,
                       int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V, int64_t W, float eps, int n_threads);

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
        if (rc == 0) rc = mtp_swiglu(gate, up, gate, T * F, n_threads);
        if (rc == 0) rc = mtp_matmul(t_down, w_down, E, F, gate, T, seq_len, out, n_threads);
    }
    free(gate);
    free(up);
    return rc;
}

/* softplus as torch computes it (threshold 20): x above it is returned as is */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* The mixer's gates for T rows of Hv heads, in place: beta = sigmoid(beta), g = a * softplus(alpha + dt_bias) with
 * alpha arriving in g. Exported so that the split-matrix path (ops.gated_delta) rounds them as the fused mixer does:
 * torch's sigmoid and softplus differ from libm's in the last bit for some inputs, and the states then drift. */
void mtp_gdn_gates(float *beta, float *g, const float *dt_bias, const float *a, int64_t T, int64_t Hv) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < Hv; j++) {
            beta[t * Hv + j] = 1.0f / (1.0f + expf(-beta[t * Hv + j]));
            g[t * Hv + j] = a[j] * softplus(g[t * Hv + j] + dt_bias[j]);
        }
}

/* The mixer's input projections for T rows (types/W: qkv [C, E], z [Hv V, E], beta [Hv, E], alpha [Hv, E]) into
 * buf = mixed [T, C] | z [T, Hv V] | beta [T, Hv] | g [T, Hv], then beta = sigmoid, g = a * softplus(alpha + dt_bias). */
static int gdn_project(const float *h, int64_t T, int64_t seq_len, int64_t E, const int *types, const uint8_t *const *W,
                       const float *dt_bias, const float *a, int64_t C, int64_t Hv, int64_t V, float *buf, int n_threads) {
    float *mixed = buf, *z = mixed + T * C, *beta = z + T * Hv * V, *g = beta + T * Hv;
    const int64_t rows[4] = {C, Hv * V, Hv, Hv};
    float *outs[4] = {mixed, z, beta, g};
    const int rc = mtp_matmul_many(4, types, W, rows, E, h, T, seq_len, outs, n_threads);
    if (rc) return rc;
    mtp_gdn_gates(beta, g, dt_bias, a, T, Hv);
    return 0;
}

/* Gated DeltaNet mixers of n_seq = T / seq_len sequences of seq_len tokens each, from the normed input
 * h [T, E] to the output [T, E]: projections for all rows at once (gdn_project), then per sequence
 * mtp_gdn_recurrence on its own conv_states[s] / ssms[s] (updated in place; with ssm_steps / conv_steps, the
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
    int rc = gdn_project(h, T, seq_len, E, types, W, dt_bias, a, C, Hv, V, buf, n_threads);
    for (int64_t s = 0; s < T / seq_len && rc == 0; s++) {
        const int64_t r0 = s * seq_len;
        rc = mtp_gdn_recurrence(mixed + r0 * C, conv_states[s], conv_w, z + r0 * Hv * V, beta + r0 * Hv, g + r0 * Hv,
                                ssms[s], norm_w, y + r0 * Hv * V, ssm_steps ? ssm_steps[s] : NULL,
                                conv_steps ? conv_steps[s] : NULL, seq_len, Hk, Hv, K, V, n_conv, eps, n_threads);
    }
    if (rc == 0) rc = mtp_matmul(t_out, w_out, E, Hv * V, y, T, seq_len, out, n_threads);
    free(buf);
    return rc;
}

/* A prompt's mixer, one sequence of T tokens: mtp_gdn_mixer's numbers (the recurrence token by token, as
 * llama.cpp's CPU runs its fused Gated DeltaNet for prompts too), keeping the states after keep_at[i] tokens
 * (ascending, within 1..T) in conv_kept[i] [C, W-1] and ssm_kept[i] [Hv, K, V]: prefix-cache checkpoints. */
int mtp_gdn_prompt(const float *h, int64_t T, int64_t E, const int *types, const uint8_t *const *W, const float *dt_bias,
                   const float *a, float *conv_state, const float *conv_w, float *ssm, const float *norm_w, int64_t Hk,
                   int64_t Hv, int64_t K, int64_t V, int64_t n_conv, float eps, int t_out, const uint8_t *w_out,
                   int64_t n_keep, const int64_t *keep_at, float *const *conv_kept, float *const *ssm_kept, float *out,
                   int n_threads) {
    const int64_t C = 2 * Hk * K + Hv * V;
    for (int64_t i = 0; i < n_keep; i++)
        if (keep_at[i] < 1 || keep_at[i] > T || (i && keep_at[i] <= keep_at[i - 1])) return 1;
    float *buf = malloc(sizeof(float) * T * (C + Hv * V + 2 * Hv + Hv * V));
    if (!buf) return 2;
    float *mixed = buf, *z = mixed + T * C, *beta = z + T * Hv * V, *g = beta + T * Hv, *y = g + T * Hv;
    int rc = gdn_project(h, T, T, E, types, W, dt_bias, a, C, Hv, V, buf, n_threads);
    for (int64_t i = 0, t0 = 0; i <= n_keep && rc == 0; i++) { /* segments between the kept states */
        const int64_t t1 = i < n_keep ? keep_at[i] : T;
        if (t1 > t0)
            rc = mtp_gdn_recurrence(mixed + t0 * C, conv_state, conv_w, z + t0 * Hv * V, beta + t0 * Hv, g + t0 * Hv, ssm,
                                    norm_w, y + t0 * Hv * V, NULL, NULL, t1 - t0, Hk, Hv, K, V, n_conv, eps, n_threads);
        if (rc == 0 && i < n_keep) {
            memcpy(conv_kept[i], conv_state, sizeof(float) * C * (n_conv - 1));
            memcpy(ssm_kept[i], ssm, sizeof(float) * Hv * K * V);
        }
        t0 = t1;
    }
    if (rc == 0) rc = mtp_matmul(t_out, w_out, E, Hv * V, y, T, T, out, n_threads);
    free(buf);
    return rc;
}

int mtp_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, int n_threads);

/* y = x + out, in order: the residual add as torch does it (y may alias x) */
static void residual_add(const float *x, const float *out, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] + out[i];
}

/* A pre-norm residual Gated DeltaNet mixer: y = x + mtp_gdn_mixer(rms_norm(x) * norm_w, ...) (y may alias x). */
int mtp_residual_gdn_mixer(const float *x, int64_t T, int64_t seq_len, int64_t E, const float *in_norm_w, float in_eps,
                           const int *types, const uint8_t *const *W, const float *dt_bias, const float *a,
                           float *const *conv_states, const float *conv_w, float *const *ssms, const float *norm_w,
                           int64_t Hk, int64_t Hv, int64_t K, int64_t V, int64_t n_conv, float eps, int t_out,
                           const uint8_t *w_out, float *y, float *const *ssm_steps, float *const *conv_steps,
                           int n_threads) {
    float *h = thread_floats(2 * T * E);
    if (!h) return 2;
    float *out = h + T * E;
    mtp_rms_norm(x, in_norm_w, h, T, E, in_eps, n_threads);
    const int rc = mtp_gdn_mixer(h, T, seq_len, E, types, W, dt_bias, a, conv_states, conv_w, ssms, norm_w, Hk, Hv, K, V,
                                 n_conv, eps, t_out, w_out, out, ssm_steps, conv_steps, n_threads);
    if (rc == 0) residual_add(x, out, y, T * E);
    return rc;
}

int mtp_rope_apply(float *x, const float *cos_c, const float *sin_c, int64_t T, int64_t H, int64_t D, int64_t n_rot, int neox);
int mtp_attention(const float *q, const void *kp, const void *vp, int kv_f16, const int64_t *q_pos, const int64_t *k_pos,
                  int64_t T, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale, int64_t window, int v_acc_f16,
                  int64_t n_cells, int64_t n_split, float *out, int n_threads);

int mtp_sigmoid_gate(const float *x, const float *g, float *y, int64_t n);

/* The arguments of one attention block over one sequence's cache (constant for the sequence state's life), and of
 * one step of T tokens at positions start..start+T-1 (set per step). The decode program's structs: Python mirror
 * ops/decode_program.py. */
typedef struct {
    const float *norm_w;
    float eps;
    const int *qkv_types;
    const uint8_t *const *qkv_W;
    int64_t H, Hkv, D;
    int q_gated, neox, rope, kv_f16; /* rope: which of mtp_step's tables */
    const float *q_norm, *k_norm;
    float q_scale, scale;
    void *k_cache, *v_cache;
    int64_t *cell_pos;
    int64_t window;
    int t_out;
    const uint8_t *w_out;
    const float *post_norm;
    int64_t ring; /* a sliding window's ring of this many cells (position p in cell p % ring); 0: cell = position */
} mtp_attention_block;

typedef struct {
    const float *cos[2], *sin[2]; /* each RoPE table's rows for the step's positions: [T, n_rot / 2] */
    int64_t n_rot[2];
    int64_t start;            /* the first token's position (= its KV cell: ordered caches) */
    int64_t n_cells, n_split; /* mtp_attention's view of the caches for the step's tokens */
    int64_t ring_n_cells, ring_n_split; /* the same of the ring caches (every ring of a program one size) */
} mtp_step;

/* The attention block's middle for one sequence's T rows, after the QKV projections (qg [T, nqg], k, v [T, nkv]):
 * optional per-head RMSNorm of q and k; RoPE (the step's rows of table c->rope); k, v stored in cells start.. (f16
 * rounded to nearest even) with their positions; attention over cells 0..start+T-1 (the step's n_cells / n_split);
 * the output gate. o [T, nq]; q [T, nq] is scratch. A ring stores position p in cell p % ring and attends over its
 * filled cells in cell order, keys told apart by their positions (those past the window masked), as the layer
 * path reads it. */
static int attention_rows(const mtp_attention_block *c, const mtp_step *st, int64_t T, float *qg, float *k,
                          const float *v, float *q, float *o, int n_threads) {
    const int64_t H = c->H, Hkv = c->Hkv, D = c->D, nq = H * D, nkv = Hkv * D, start = st->start;
    int64_t q_pos[8];
    if (T > 8) return 1;
    if (c->q_gated) /* Qwen3.5: per head a query row, then its output gate row */
        for (int64_t th = 0; th < T * H; th++) memcpy(q + th * D, qg + 2 * th * D, sizeof(float) * D);
    else
        memcpy(q, qg, sizeof(float) * T * nq);
    if (c->q_norm) mtp_rms_norm(q, c->q_norm, q, T * H, D, c->eps, n_threads);
    if (c->k_norm) mtp_rms_norm(k, c->k_norm, k, T * Hkv, D, c->eps, n_threads);
    const float *cos_c = st->cos[c->rope], *sin_c = st->sin[c->rope];
    mtp_rope_apply(q, cos_c, sin_c, T, H, D, st->n_rot[c->rope], c->neox);
    mtp_rope_apply(k, cos_c, sin_c, T, Hkv, D, st->n_rot[c->rope], c->neox);
    if (c->q_scale != 1.0f) /* Gemma: the query scaled before attention, the softmax scale then 1 */
        for (int64_t i = 0; i < T * nq; i++) q[i] *= c->q_scale;
    for (int64_t t = 0; t < T; t++) {
        const int64_t cell = c->ring ? (start + t) % c->ring : start + t;
        q_pos[t] = start + t;
        c->cell_pos[cell] = start + t;
        if (c->kv_f16) {
            half *kc = (half *)c->k_cache + cell * nkv, *vc = (half *)c->v_cache + cell * nkv;
            for (int64_t i = 0; i < nkv; i++) {
                kc[i] = f2h(k[t * nkv + i]);
                vc[i] = f2h(v[t * nkv + i]);
            }
        } else {
            memcpy((float *)c->k_cache + cell * nkv, k + t * nkv, sizeof(float) * nkv);
            memcpy((float *)c->v_cache + cell * nkv, v + t * nkv, sizeof(float) * nkv);
        }
    }
    const int64_t S = c->ring && start + T > c->ring ? c->ring : start + T;
    const int rc = mtp_attention(q, c->k_cache, c->v_cache, c->kv_f16, q_pos, c->cell_pos, T, S, H, Hkv, D, c->scale,
                                 c->window, c->kv_f16, c->ring ? st->ring_n_cells : st->n_cells,
                                 c->ring ? st->ring_n_split : st->n_split, o, n_threads);
    if (rc) return rc;
    if (c->q_gated)
        for (int64_t th = 0; th < T * H; th++) mtp_sigmoid_gate(o + th * D, qg + (2 * th + 1) * D, o + th * D, D);
    return 0;
}

/* A pre-norm residual attention block for n_seq sequences of T tokens each over ordered f16/f32 KV caches (cell i
 * holds position i): h = rms_norm(x) * norm_w; q, k, v = h Wq, h Wk, h Wv for all rows at once (each sequence rounded
 * as if alone); attention_rows per sequence (per_seq[s], steps[s]); y = x + o Wo (y may alias x), with Gemma's norm
 * after the block where post_norm is given. The weights are per_seq[0]'s (every sequence's are the same layer's). */
static int attention_block(const mtp_attention_block *const *per_seq, const mtp_step *steps, int64_t n_seq, int64_t T,
                           const float *x, int64_t E, float *y, int n_threads) {
    const mtp_attention_block *b = per_seq[0];
    const int64_t m = n_seq * T, nq = b->H * b->D, nkv = b->Hkv * b->D, nqg = b->q_gated ? 2 * nq : nq;
    if (T > 8) return 1;
    float *h = thread_floats(m * (E + nqg + 2 * nkv + nq + nq + E));
    if (!h) return 2;
    float *qg = h + m * E, *k = qg + m * nqg, *v = k + m * nkv, *q = v + m * nkv, *o = q + m * nq, *out = o + m * nq;
    mtp_rms_norm(x, b->norm_w, h, m, E, b->eps, n_threads);
    const int64_t rows[3] = {nqg, nkv, nkv};
    float *outs[3] = {qg, k, v};
    int rc = mtp_matmul_many(3, b->qkv_types, b->qkv_W, rows, E, h, m, T, outs, n_threads);
    for (int64_t s = 0; s < n_seq && rc == 0; s++) {
        const int64_t r = s * T;
        rc = attention_rows(per_seq[s], steps + s, T, qg + r * nqg, k + r * nkv, v + r * nkv, q + r * nq, o + r * nq,
                            n_threads);
    }
    if (rc == 0) rc = mtp_matmul(b->t_out, b->w_out, E, nq, o, m, T, out, n_threads);
    if (rc) return rc;
    if (b->post_norm) mtp_rms_norm(out, b->post_norm, out, m, E, b->eps, n_threads); /* Gemma: a norm after the block too */
    residual_add(x, out, y, m * E);
    return 0;
}

/* attention_block for a few tokens of one sequence, its arguments one by one (the layers' call, cache/kv.py). */
int mtp_residual_attention(const float *x, int64_t T, int64_t E, const float *norm_w, float eps, const int *qkv_types,
                           const uint8_t *const *qkv_W, int64_t H, int64_t Hkv, int64_t D, int q_gated, const float *q_norm,
                           const float *k_norm, const float *cos_c, const float *sin_c, int64_t n_rot, int neox,
                           float q_scale, void *k_cache, void *v_cache, int kv_f16, int64_t *cell_pos, int64_t start,
                           float scale, int64_t window, int64_t n_cells, int64_t n_split, int t_out, const uint8_t *w_out,
                           const float *post_norm, float *y, int n_threads) {
    const mtp_attention_block b = {
        .norm_w = norm_w, .eps = eps, .qkv_types = qkv_types, .qkv_W = qkv_W, .H = H, .Hkv = Hkv, .D = D,
        .q_gated = q_gated, .neox = neox, .rope = 0, .kv_f16 = kv_f16, .q_norm = q_norm, .k_norm = k_norm,
        .q_scale = q_scale, .scale = scale, .k_cache = k_cache, .v_cache = v_cache, .cell_pos = cell_pos,
        .window = window, .t_out = t_out, .w_out = w_out, .post_norm = post_norm,
    };
    const mtp_step st = {.cos = {cos_c}, .sin = {sin_c}, .n_rot = {n_rot}, .start = start, .n_cells = n_cells,
                         .n_split = n_split};
    const mtp_attention_block *per_seq[1] = {&b};
    return attention_block(per_seq, &st, 1, T, x, E, y, n_threads);
}

int mtp_geglu(const float *x, const float *g, float *y, int64_t n, int n_threads);

/* A pre-norm residual gated FFN: y [T, E] = x + post(down(act(gate(h)) * up(h))) with h = rms_norm(x) * norm_w, act
 * SiLU (gelu = 0: mtp_swiglu, as mtp_swiglu_ffn) or llama.cpp's GELU table (gelu = 1: mtp_geglu, Gemma), and post
 * the RMSNorm by post_w (Gemma's norm after the FFN) or nothing (post_w NULL); y may alias x. The composition of
 * mtp_rms_norm, mtp_matmul_many, the activation, mtp_matmul and the add, in one call. */
int mtp_residual_glu_ffn(const float *x, int64_t T, int64_t seq_len, int64_t E, const float *norm_w, float eps, int gelu,
                         int t_gate, const uint8_t *w_gate, int t_up, const uint8_t *w_up, int64_t F, int t_down,
                         const uint8_t *w_down, const float *post_w, float *y, int n_threads) {
    float *h = thread_floats(T * (2 * E + 2 * F));
    if (!h) return 2;
    float *out = h + T * E, *gate = out + T * E, *up = gate + T * F;
    mtp_rms_norm(x, norm_w, h, T, E, eps, n_threads);
    const int types[2] = {t_gate, t_up};
    const uint8_t *W[2] = {w_gate, w_up};
    const int64_t rows[2] = {F, F};
    float *outs[2] = {gate, up};
    int rc = mtp_matmul_many(2, types, W, rows, E, h, T, seq_len, outs, n_threads);
    if (rc) return rc;
    if (gelu) mtp_geglu(gate, up, gate, T * F, n_threads);
    else mtp_swiglu(gate, up, gate, T * F, n_threads);
    rc = mtp_matmul(t_down, w_down, E, F, gate, T, seq_len, out, n_threads);
    if (rc) return rc;
    if (post_w) mtp_rms_norm(out, post_w, out, T, E, eps, n_threads);
    residual_add(x, out, y, T * E);
    return 0;
}

/* ---- a decode step's blocks in one call ------------------------------------------------------------------------ */

/* A decode step (1-8 tokens of each of one or more sequences) runs its blocks in order over the residual stream,
 * each the entry point above with the arguments a block's Python call would pass: on a 9M-parameter model the
 * Python around ~20 calls a token cost as much as their arithmetic. The constant arguments sit in one struct a block
 * (built once per sequence state: its recurrent state and KV cache pointers are fixed for the state's life), the
 * position-dependent ones in mtp_step (set per step). Python mirror: ops/decode_program.py. */

typedef struct {
    const float *norm_w;
    float eps;
    const int *types;
    const uint8_t *const *W;
    const float *dt_bias, *a, *conv_w, *ssm_norm_w;
    float *conv_state, *ssm;
    int64_t Hk, Hv, K, V, n_conv;
    float ssm_eps;
    int t_out;
    const uint8_t *w_out;
} mtp_gdn_block;

typedef struct {
    const float *norm_w;
    float eps;
    int gelu, t_gate, t_up, t_down;
    const uint8_t *w_gate, *w_up, *w_down;
    int64_t F;
    const float *post_w;
} mtp_ffn_block;

enum { BLOCK_ATTENTION = 0, BLOCK_GDN = 1, BLOCK_FFN = 2 };

typedef struct {
    int kind;
    const void *args;
} mtp_block;

/* One decode step of n_seq sequences of T tokens each (T = 1: a decode; 2-8: a draft's verification): x [n_seq T, E]
 * <- each sequence's blocks (tables[s], the same layers in the same order over its own caches and states) applied
 * in order, sequence s's rows at steps[s] (positions start..start+T-1). The matmuls take every sequence's rows in
 * one call (m = n_seq T, each sequence rounded as if alone: the numbers of each sequence stepped alone, bit for
 * bit); the attention over a sequence's cache and the DeltaNet recurrence run per sequence. With ssm_steps /
 * conv_steps, the g-th DeltaNet block keeps sequence s's states after every token in ssm_steps[g n_seq + s]
 * [T, Hv, K, V] and conv_steps[g n_seq + s] [T, C, W-1] (a verification's rollback points). */
int mtp_run_blocks(const mtp_block *const *tables, int64_t n_seq, int64_t T, int64_t n_blocks, float *x, int64_t E,
                   const mtp_step *steps, float *const *ssm_steps, float *const *conv_steps, int n_threads) {
    if (T < 1 || T > 8) return 1;
    void **per_seq = malloc(sizeof(void *) * 3 * n_seq); /* each sequence's block of the current layer */
    if (!per_seq) return 2;
    const mtp_attention_block **attn = (const mtp_attention_block **)per_seq;
    float **conv = (float **)per_seq + n_seq, **ssm = conv + n_seq;
    const int64_t m = n_seq * T;
    int rc = 0;
    for (int64_t i = 0, g = 0; i < n_blocks && rc == 0; i++) {
        const int kind = tables[0][i].kind;
        for (int64_t s = 1; s < n_seq; s++)
            if (tables[s][i].kind != kind) rc = 1;
        if (rc) break;
        if (kind == BLOCK_ATTENTION) {
            for (int64_t s = 0; s < n_seq; s++) attn[s] = tables[s][i].args;
            rc = attention_block(attn, steps, n_seq, T, x, E, x, n_threads);
        } else if (kind == BLOCK_GDN) {
            const mtp_gdn_block *b = tables[0][i].args;
            for (int64_t s = 0; s < n_seq; s++) {
                const mtp_gdn_block *c = tables[s][i].args;
                conv[s] = c->conv_state;
                ssm[s] = c->ssm;
            }
            float *const *kept_ssm = ssm_steps ? ssm_steps + g * n_seq : NULL;
            float *const *kept_conv = conv_steps ? conv_steps + g * n_seq : NULL;
            rc = mtp_residual_gdn_mixer(x, m, T, E, b->norm_w, b->eps, b->types, b->W, b->dt_bias, b->a, conv, b->conv_w,
                                        ssm, b->ssm_norm_w, b->Hk, b->Hv, b->K, b->V, b->n_conv, b->ssm_eps, b->t_out,
                                        b->w_out, x, kept_ssm, kept_conv, n_threads);
            g++;
        } else if (kind == BLOCK_FFN) {
            const mtp_ffn_block *b = tables[0][i].args;
            rc = mtp_residual_glu_ffn(x, m, T, E, b->norm_w, b->eps, b->gelu, b->t_gate, b->w_gate, b->t_up, b->w_up,
                                      b->F, b->t_down, b->w_down, b->post_w, x, n_threads);
        } else {
            rc = 1;
        }
    }
    free(per_seq);
    return rc;
}

/* ---- a whole decode pass in one call ------------------------------------------------------------------------------- */

int mtp_get_rows(int type, const uint8_t *W, int64_t n_rows, int64_t k, const int64_t *idx, int64_t n, float *out);

/* What a decode pass reads around its blocks: the token table (its rows times embed_scale where that is not 1:
 * Gemma's), the final norm and the output layer. Python mirror: ops/decode_program.py DecodeHead. */
typedef struct {
    int t_table;
    const uint8_t *table;
    int64_t n_table;
    float embed_scale;
    const float *out_norm;
    float eps;
    int t_out;
    const uint8_t *out;
    int64_t n_vocab, E;
} mtp_decode_head;

/* mtp_run_blocks between the model's first and last steps, as the layer path calls them: x [n_seq T, E] <- the
 * tokens' rows of the table (scaled), the blocks, the final norm (in place: x is the pass's hidden states); then
 * with logits, logits [n_seq T, n_vocab] <- the output layer's product (each sequence rounded as if alone). On a
 * small model the Python of those three steps cost half as much again as the blocks' C (its code and data were
 * out of the caches the blocks had just streamed the weights through). Returns -3 for a token id outside the table. */
int mtp_decode_pass(const mtp_decode_head *h, const mtp_block *const *tables, int64_t n_seq, int64_t T,
                    int64_t n_blocks, const int64_t *tokens, float *x, const mtp_step *steps, float *const *ssm_steps,
                    float *const *conv_steps, float *logits, int n_threads) {
    const int64_t m = n_seq * T, E = h->E;
    int rc = mtp_get_rows(h->t_table, h->table, h->n_table, E, tokens, m, x);
    if (rc) return rc == 3 ? -3 : rc;
    if (h->embed_scale != 1.0f)
        for (int64_t i = 0; i < m * E; i++) x[i] *= h->embed_scale;
    rc = mtp_run_blocks(tables, n_seq, T, n_blocks, x, E, steps, ssm_steps, conv_steps, n_threads);
    if (rc) return rc;
    mtp_rms_norm(x, h->out_norm, x, m, E, h->eps, n_threads);
    return logits ? mtp_matmul(h->t_out, h->out, h->n_vocab, E, x, m, T, logits, n_threads) : 0;
}

/* ---- MTP drafts in one call ------------------------------------------------------------------------------------ */

/* What a chain of MTP draft steps reads: the NextN block's token table, its two input norms and eh_proj [E, 2E], the
 * block itself (a decode program's table over the MTP cache), its final norm and the head's rows (the draft
 * vocabulary). Python mirror: ops/decode_program.py DraftModel. */
typedef struct {
    int t_table;
    const uint8_t *table;
    int64_t n_table;
    const float *enorm, *hnorm, *out_norm;
    float eps;
    int t_eh;
    const uint8_t *eh;
    const mtp_block *blocks;
    int64_t n_blocks;
    int t_head;
    const uint8_t *head;
    int64_t n_head, E;
} mtp_draft_model;

/* The n largest of v[0..len), largest first, equal values by index (the host's ranking). */
static void top_n_sorted(const float *v, int64_t len, int64_t n, float *vals, int64_t *ids) {
    int64_t kept = 0;
    for (int64_t i = 0; i < len; i++) {
        const float x = v[i];
        if (kept == n && !(x > vals[n - 1])) continue;
        int64_t j = kept < n ? kept++ : n - 1;
        while (j > 0 && vals[j - 1] < x) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        vals[j] = x;
        ids[j] = i;
    }
}

/* The top_k largest of v[0..n) (top_k <= 64): returns the first index of the largest, and p = the largest's softmax
 * over the top_k (float32 exponentials of v_i - max summed in descending order): the draft's confidence. */
static int64_t draft_top(const float *v, int64_t n, int top_k, float *p) {
    float best[64];
    int64_t ids[64];
    const int64_t kept = n < top_k ? n : top_k;
    top_n_sorted(v, n, kept, best, ids);
    float sum = 0.0f;
    for (int64_t j = 0; j < kept; j++) sum += expf(best[j] - best[0]);
    *p = 1.0f / sum;
    return ids[0];
}

/* Drafts drawn from the request's sampler chain (engine.sampling; the CPU twin of ops/sampling_chain.py): its float
 * parameters, one uniform a step, and where each step's candidates and distribution go. */
typedef struct {
    int64_t n_top, min_keep; /* candidates ranked (top-k raised to min_keep, at most CHAIN_MAX_TOP); min_keep */
    float top_p, temperature; /* top_p: INFINITY where the chain has none */
    double log_min_p;         /* -INFINITY where the chain has none */
    const double *uniforms;   /* [n_steps] */
    int64_t *out_ids;         /* [n_steps, n_top]: each step's candidates, highest first */
    double *out_probs;        /* [n_steps, n_top]: their probabilities, 0 past the survivors */
    int64_t *out_kept;        /* [n_steps]: the survivors */
    const int64_t *banned;    /* tokens a -inf bias bans (ignore_eos's end tokens), below the head's rows */
    int64_t n_banned;
} mtp_draft_draws;

#define CHAIN_MAX_TOP 1024 /* engine.sampling.DEVICE_TOP_MAX: the most candidates a chain off the host ranks */

/* The chain over the n_top candidates `vals` (highest first): top-p at temperature 1 in float32 (sums in order),
 * min-p, the temperature, a float64 softmax over the survivors (engine.sampling's Sampler.probabilities). Returns
 * the survivors; probs[0..n_top), 0 past them. */
static int64_t chain_probs(const float *vals, const mtp_draft_draws *c, double *probs) {
    const int64_t n = c->n_top;
    int64_t keep = n;
    if (c->top_p < INFINITY) {
        float w[CHAIN_MAX_TOP], total = 0.0f, running = 0.0f;
        for (int64_t i = 0; i < n; i++) total += (w[i] = expf(vals[i] - vals[0]));
        for (int64_t i = 0; i < n; i++)
            if ((running += w[i] / total) >= c->top_p) {
                keep = i + 1;
                break;
            }
        if (keep < (c->min_keep < n ? c->min_keep : n)) keep = c->min_keep < n ? c->min_keep : n;
    }
    if (c->log_min_p > -INFINITY) {
        const float threshold = (float)((double)vals[0] + c->log_min_p);
        const int64_t least = c->min_keep > 1 ? c->min_keep : 1;
        int64_t above = 0;
        while (above < keep && vals[above] >= threshold) above++;
        keep = above >= least ? above : (least < keep ? least : keep);
    }
    const double top = (double)(vals[0] / c->temperature);
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (probs[i] = i < keep ? exp((double)(vals[i] / c->temperature) - top) : 0.0);
    for (int64_t i = 0; i < n; i++) probs[i] /= sum;
    return keep;
}

/* The first of weights[0..n) whose running float64 sum passes the total times u (engine.rejection's draw). */
static int64_t draw_place(const double *weights, int64_t n, double u) {
    double total = 0.0, running = 0.0;
    for (int64_t i = 0; i < n; i++) total += weights[i];
    const double target = total * u;
    int64_t index = 0;
    for (int64_t i = 0; i < n; i++)
        if ((running += weights[i]) <= target) index = i + 1;
    return index < n ? index : n - 1;
}

/* The chain's draw: its distribution over the candidates, then one draw with u. Returns the place; probs, *kept. */
static int64_t chain_draw(const float *vals, const mtp_draft_draws *c, double u, double *probs, int64_t *kept) {
    *kept = chain_probs(vals, c, probs);
    return draw_place(probs, *kept, u); /* the zeros past the survivors add nothing to the total */
}

/* A row's n candidates, highest first, equal values by id, from a device's k = n + 1 (or n) highest: values then
 * ids (as floats) in cand[0..2k). */
static void device_candidates(const float *cand, int64_t k, int64_t n, float *vals, int64_t *ids) {
    for (int64_t i = 0; i < n; i++) {
        vals[i] = cand[i];
        ids[i] = (int64_t)cand[k + i];
        for (int64_t j = i; j > 0 && vals[j - 1] == vals[j] && ids[j - 1] > ids[j]; j--) { /* a device's ties */
            const int64_t id = ids[j];
            ids[j] = ids[j - 1];
            ids[j - 1] = id;
        }
    }
}

/* The probability of token t in a draft's distribution q [ids | probs] (q_width each, ids -1 past its tokens). */
static double q_of(const double *q, int64_t q_width, int64_t t) {
    for (int64_t j = 0; j < q_width; j++)
        if ((int64_t)q[j] == t) return q[q_width + j];
    return 0.0;
}

/* A verification's rows against drafts drawn from the same chain, engine.rejection's rule in its order: row i of
 * n_drafts keeps drafts[i] when u * q(d) < p(d) (no uniform taken where q(d) is 0), p the chain over the row's
 * candidates and q the draft's distribution (qs [n_drafts, 2 * q_width]: ids, then probabilities), or else draws
 * from the normalised max(0, p - q) over p's survivors in order (from p where that is empty) with the next uniform,
 * and stops there. The row after the drafts draws from the chain as Sampler.sample does (float32 exponentials,
 * their float64 running sum, the first place reaching the total times its uniform). The rows' candidates: ranked
 * here from rows [n_drafts + 1, n_vocab] (the chain's bans set to -inf first), or a device's k highest of each row,
 * cands [n_drafts + 1, 2k]. uniforms: the draft stream's n_drafts + 1, then the main stream's one. out
 * [n_drafts + 3]: the tokens kept, then how many, then the draft stream's uniforms taken (the main one is taken where
 * every draft is kept). Returns 3 (nothing taken) where a device's candidates tie at the chain's n-th place. */
int mtp_verify_drawn(const float *rows, int64_t n_vocab, const float *cands, int64_t k, const mtp_draft_draws *c,
                     const int64_t *drafts, int64_t n_drafts, const double *qs, int64_t q_width,
                     const double *uniforms, int64_t *out) {
    const int64_t n = c->n_top, n_rows = n_drafts + 1;
    int64_t *n_out = out + n_rows, *taken = out + n_rows + 1;
    *n_out = *taken = 0;
    if (n < 1 || n > CHAIN_MAX_TOP || n_drafts < 0 || (rows ? n > n_vocab : k < n || k > n + 1)) return 1;
    for (int64_t r = 0; !rows && r < n_rows; r++)
        if (k > n && cands[r * 2 * k + n] == cands[r * 2 * k + n - 1]) return 3;
    float vals[CHAIN_MAX_TOP];
    int64_t ids[CHAIN_MAX_TOP], places[CHAIN_MAX_TOP];
    double p[CHAIN_MAX_TOP], residual[CHAIN_MAX_TOP];
    for (int64_t r = 0; r < n_rows; r++) {
        if (!rows) {
            device_candidates(cands + r * 2 * k, k, n, vals, ids);
        } else if (c->n_banned) {
            float *copy = malloc(sizeof(float) * n_vocab);
            if (!copy) return 2;
            memcpy(copy, rows + r * n_vocab, sizeof(float) * n_vocab);
            for (int64_t b = 0; b < c->n_banned; b++) copy[c->banned[b]] = -INFINITY;
            top_n_sorted(copy, n_vocab, n, vals, ids);
            free(copy);
        } else {
            top_n_sorted(rows + r * n_vocab, n_vocab, n, vals, ids);
        }
        const int64_t keep = chain_probs(vals, c, p);
        if (r == n_drafts) { /* the row after the drafts: Sampler.sample's draw */
            const float top = vals[0] / c->temperature;
            double total = 0.0;
            for (int64_t i = 0; i < keep; i++) residual[i] = (total += (double)expf(vals[i] / c->temperature - top));
            const double target = total * uniforms[n_rows];
            int64_t place = 0;
            while (place < keep - 1 && residual[place] < target) place++;
            out[(*n_out)++] = ids[place];
            return 0;
        }
        const int64_t d = drafts[r];
        const double *q = qs + r * 2 * q_width, q_d = q_of(q, q_width, d);
        double p_d = 0.0;
        for (int64_t i = 0; i < keep; i++)
            if (ids[i] == d) p_d = p[i];
        if (q_d > 0.0 && uniforms[(*taken)++] * q_d < p_d) {
            out[(*n_out)++] = d;
            continue;
        }
        int64_t m = 0;
        for (int64_t i = 0; i < keep; i++) {
            const double q_t = q_of(q, q_width, ids[i]);
            if (p[i] > q_t) {
                residual[m] = p[i] - q_t;
                places[m++] = i;
            }
        }
        const double u = uniforms[(*taken)++];
        out[(*n_out)++] = m ? ids[places[draw_place(residual, m, u)]] : ids[draw_place(p, keep, u)];
        return 0;
    }
    return 0;
}

/* Up to n_steps chained MTP drafts: step 0 takes T0 rows (tokens[t] paired with the hidden state hidden[t] that
 * predicted it: the waiting catch-up rows, then the sampled token's) and drafts from its last row; step s > 0 takes
 * the previous draft and the MTP block's own last output. Each step is the eager path's sequence of calls (rows of the
 * table, the two norms side by side, eh_proj, the block at steps[s], the final norm, the head), then the head row's
 * argmax and its softmax over the top_k: out_tokens[s], out_p[s]. The chain stops after the first step whose p is
 * below p_min (the drafter drops it and what would follow); *n_done: the steps run. The block's cache cells at
 * steps[s].start.. are written as the eager path writes them. out_row and out_hidden (or NULL): the last step's head
 * row and its output hidden state (the next step's input), for a draft drawn on the host one step a call. draws (or
 * NULL): each step's token drawn from the request's chain over the head's row rather than its argmax. */
int mtp_draft_chain(const mtp_draft_model *d, const float *hidden, const int64_t *tokens, int64_t T0,
                    const mtp_step *steps, int64_t n_steps, int top_k, float p_min, int64_t *out_tokens, float *out_p,
                    int64_t *n_done, float *out_row, float *out_hidden, const mtp_draft_draws *draws, int n_threads) {
    const int64_t E = d->E;
    *n_done = 0;
    if (T0 < 1 || T0 > 8 || top_k < 1 || top_k > 64) return 1;
    if (draws && (draws->n_top < 1 || draws->n_top > CHAIN_MAX_TOP || draws->n_top > d->n_head)) return 1;
    for (int64_t b = 0; draws && b < draws->n_banned; b++)
        if (draws->banned[b] < 0 || draws->banned[b] >= d->n_head) return 1;
    float *buf = malloc(sizeof(float) * (T0 * E * 3 + T0 * 2 * E + d->n_head));
    if (!buf) return 2;
    float *e = buf, *h = e + T0 * E, *u = h + T0 * E, *in = u + T0 * E, *row = in + T0 * 2 * E;
    memcpy(h, hidden, sizeof(float) * T0 * E);
    const mtp_block *table[1] = {d->blocks};
    int rc = 0;
    for (int64_t s = 0; s < n_steps && rc == 0; s++) {
        const int64_t T = s == 0 ? T0 : 1;
        rc = mtp_get_rows(d->t_table, d->table, d->n_table, E, s == 0 ? tokens : out_tokens + s - 1, T, e);
        if (rc) break;
        for (int64_t t = 0; t < T; t++) { /* [norm(e_t) | norm(h_t)] */
            mtp_rms_norm(e + t * E, d->enorm, in + t * 2 * E, 1, E, d->eps, 1);
            mtp_rms_norm(h + t * E, d->hnorm, in + t * 2 * E + E, 1, E, d->eps, 1);
        }
        rc = mtp_matmul(d->t_eh, d->eh, E, 2 * E, in, T, T, u, n_threads);
        if (rc == 0) rc = mtp_run_blocks(table, 1, T, d->n_blocks, u, E, steps + s, NULL, NULL, n_threads);
        if (rc) break;
        mtp_rms_norm(u + (T - 1) * E, d->out_norm, h, 1, E, d->eps, 1); /* the next step's hidden state */
        rc = mtp_matmul(d->t_head, d->head, d->n_head, E, h, 1, 1, row, n_threads);
        if (rc) break;
        out_tokens[s] = draft_top(row, d->n_head, top_k, out_p + s);
        if (out_row) memcpy(out_row, row, sizeof(float) * d->n_head);
        if (draws) { /* drawn from the chain; out_p stays the argmax's (p_min measures the draft's confidence) */
            float vals[CHAIN_MAX_TOP];
            for (int64_t b = 0; b < draws->n_banned; b++) row[draws->banned[b]] = -INFINITY;
            int64_t *ids = draws->out_ids + s * draws->n_top;
            top_n_sorted(row, d->n_head, draws->n_top, vals, ids);
            const int64_t place = chain_draw(vals, draws, draws->uniforms[s], draws->out_probs + s * draws->n_top,
                                             draws->out_kept + s);
            out_tokens[s] = ids[place];
        }
        *n_done = s + 1;
        if (out_hidden) memcpy(out_hidden, h, sizeof(float) * E);
        if (out_p[s] < p_min) break;
    }
    free(buf);
    return rc;
}
