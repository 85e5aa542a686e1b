"""The gated delta rule of Gated DeltaNet on the GPU: token by token for decode and verification
(`gated_delta_rule_recurrent_batched`), and the sequential half of the chunked form for prompts
(`gated_delta_chunk_scan`). A decode layer between its two matmuls is two launches: `gdn_decode_inputs` (causal
conv update, SiLU, L2-norms of q and k) and `gated_delta_decode` (the same recurrent kernel with the gates computed
from the projections and the gated RMSNorm applied to each V head's output, one program holding a whole head).
Their PyTorch twins are mtpserve.ops.gated_delta.gdn_decode_inputs_reference / gated_delta_decode_reference.

The recurrent (token by token) gated delta rule of Gated DeltaNet for a batch of sequences, each of T <= ~8
tokens (decode, speculative verification), with the state after every token kept for rollback if asked.

Per V head h (reading q/k head h % Hk) and token t, with q, k already L2-normalised by the caller:

    S = exp(g_t) * S;  S = S + k_t (x) beta_t * (v_t - S^T k_t);  o_t = S^T (scale * q_t)

Each program owns one (sequence, V head, tile of BLOCK_V value columns): the state columns of a tile never
mix with other columns (S^T k and S^T q are per column), so its [K, BLOCK_V] slice stays in registers across
all T tokens and the state is read and written once per call, not once per token. The PyTorch twin (one
sequence) is mtpserve.ops.gated_delta.gated_delta_rule_recurrent; this module stays a leaf and imports neither.

The chunked form (../shared/spec/qwen35-architecture.md §4.6) splits a prompt into chunks of C tokens. Everything
inside a chunk that does not depend on the state entering it (the decays' cumulative sums, the triangular solve
giving U and W, the masked Q K^T) is batched over all chunks by PyTorch first. What is left is a scan over the
chunks, per V head:

    v_new = U_n - W_n S;  o_n = (exp(G_n) * Q_n) S + QK_n v_new;  S = exp(G_last) S + (exp(G_last - G_n) * K_n)^T v_new

Each program owns one (V head, tile of BLOCK_V value columns), holds its [K, BLOCK_V] state slice in registers
across every chunk, and does the four products as tl.dot with bf16 operands and float32 accumulation (the state
itself stays float32: only the copies fed to the tensor cores are rounded). float32 operands ("ieee" or tf32x3)
spill or overflow shared memory at K=V=128 on sm_80/sm_90 (tests/support/gpu_compile.py). Its twin is
mtpserve.ops.gated_delta.gated_delta_chunk_scan_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..capability import cuda_capability
from ._device import on_input_device
from .pdl import dependent_launch, launch_options

MAX_K = 256  # the state tile is [next_pow2(K), BLOCK_V] registers: beyond this BLOCK_V would shrink to nothing
_TILE = 4096  # float32 state values per program: 32 registers a thread at 4 warps, no spilling at K=128


@triton.jit
def _gated_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    s_ptr,
    steps_ptr,
    o_ptr,
    dt_bias_ptr,
    a_ptr,
    z_ptr,
    norm_ptr,
    T,
    n_steps,
    HV,
    HK,
    K,
    V,
    scale,
    eps,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_t,
    sk_h,
    sv_b,
    sv_t,
    sv_h,
    sg_b,
    sg_t,
    sg_h,
    sb_b,
    sb_t,
    sb_h,
    sz_b,
    sz_t,
    sz_h,
    K_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STORE_STEPS: tl.constexpr,
    GATES: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch(PDL)
    bh = tl.program_id(0)
    b = bh // HV
    h = bh % HV
    hk = h % HK  # the "tiled" GQA order of qwen35 GGUFs
    b64 = b.to(tl.int64)
    ks = tl.arange(0, K_PAD)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < K
    v_ok = vs < V
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = ks[:, None] * V + vs[None, :]  # offsets inside one [K, V] head state
    s_head = s_ptr + (b64 * HV + h) * K * V
    s = tl.load(s_head + tile, mask=tile_ok, other=0.0)  # padded rows/columns stay 0 through every update

    q_row = q_ptr + b64 * sq_b + hk * sq_h
    k_row = k_ptr + b64 * sk_b + hk * sk_h
    v_row = v_ptr + b64 * sv_b + h * sv_h
    g_at = g_ptr + b64 * sg_b + h * sg_h
    beta_at = beta_ptr + b64 * sb_b + h * sb_h
    o_row = o_ptr + (b64 * T * HV + h) * V
    for t in range(T):
        q = tl.load(q_row + t * sq_t + ks, mask=k_ok, other=0.0).to(tl.float32) * scale
        k = tl.load(k_row + t * sk_t + ks, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_row + t * sv_t + vs, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_at + t * sg_t).to(tl.float32)
        beta = tl.load(beta_at + t * sb_t).to(tl.float32)
        if GATES:  # g and beta arrive as projections: g = a * softplus(alpha + dt_bias), beta = sigmoid(beta)
            x = g + tl.load(dt_bias_ptr + h).to(tl.float32)
            g = tl.load(a_ptr + h).to(tl.float32) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus
            beta = tl.sigmoid(beta)
        s = s * tl.exp(g)
        delta = beta * (v - tl.sum(k[:, None] * s, axis=0))  # [BLOCK_V]: the error of the state's recall of v
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * s, axis=0)
        if NORM:  # the program holds the whole head (BLOCK_V >= V): RMSNorm(o) * norm_weight * silu(z)
            z = tl.load(z_ptr + b64 * sz_b + t * sz_t + h * sz_h + vs, mask=v_ok, other=0.0).to(tl.float32)
            weight = tl.load(norm_ptr + vs, mask=v_ok, other=0.0).to(tl.float32)
            o = o / tl.sqrt_rn(tl.sum(o * o, axis=0) / V + eps) * weight * (z * tl.sigmoid(z))
        tl.store(o_row + t * HV * V + vs, o, mask=v_ok)
        if STORE_STEPS:
            if t < n_steps:  # the first n_steps tokens' states (the caller may take the last from the state itself)
                tl.store(steps_ptr + ((b64 * T + t) * HV + h) * K * V + tile, s, mask=tile_ok)
    tl.store(s_head + tile, s, mask=tile_ok)


def default_block_v(k: int, v: int) -> int:
    """Value columns per program: the state tile at most _TILE floats, and no wider than V needs."""
    return max(1, min(triton.next_power_of_2(v), _TILE // triton.next_power_of_2(k)))


def _check_recurrent_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_steps: torch.Tensor | None,
) -> None:
    """The recurrent kernel's shape, dtype, stride and device rules (`gated_delta_rule_recurrent_batched`)."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, K], got {list(q.shape)} and {list(k.shape)}")
    n_seq, n_tok, n_k_heads, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (n_seq, n_tok):
        raise ValueError(f"v must be [{n_seq}, {n_tok}, Hv, V], got {list(v.shape)}")
    n_v_heads, V = v.shape[2:]
    if n_k_heads == 0 or n_v_heads % n_k_heads:
        raise ValueError(f"the {n_v_heads} V heads must be a multiple of the {n_k_heads} q/k heads")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (n_seq, n_tok, n_v_heads):
            raise ValueError(f"{name} must be [{n_seq}, {n_tok}, {n_v_heads}], got {list(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.dim() == 4 and x.stride(3) != 1 and x.shape[3] > 1:
            raise ValueError(f"{name} must be contiguous along its last dimension")
    if not 1 <= K <= MAX_K or V < 1:
        raise ValueError(f"head sizes must be 1 <= K <= {MAX_K} and V >= 1, got K={K}, V={V}")
    expected = (n_seq, n_v_heads, K, V)
    if state.shape != expected or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(
            f"state must be contiguous float32 {list(expected)} (it is updated in place), "
            f"got {state.dtype} {list(state.shape)}"
        )
    if state_steps is not None:
        expected = (n_seq, n_tok, n_v_heads, K, V)
        if state_steps.shape != expected or state_steps.dtype != torch.float32 or not state_steps.is_contiguous():
            raise ValueError(
                f"state_steps must be contiguous float32 {list(expected)}, "
                f"got {state_steps.dtype} {list(state_steps.shape)}"
            )
    tensors = (q, k, v, g, beta, state) + (() if state_steps is None else (state_steps,))
    if len({x.device for x in tensors}) != 1:
        raise ValueError("q, k, v, g, beta, state and state_steps must be on one device")


@on_input_device
def gated_delta_rule_recurrent_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    state_steps: torch.Tensor | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """q, k [B, T, Hk, K]; v [B, T, Hv, V]; g (log decay), beta [B, T, Hv] (any float dtype, computed in float32);
    state float32 [B, Hv, K, V], contiguous, updated in place to the state after the last token. With
    `state_steps` (contiguous float32 [B, T, Hv, K, V]) the state after every token is written there too.
    `scale` (default K^-0.5) multiplies q. Returns o float32 [B, T, Hv, V]. Inputs may be strided views
    (e.g. slices of a fused projection) as long as their last dimension is contiguous."""
    _check_recurrent_args(q, k, v, g, beta, state, state_steps)
    n_seq, n_tok, n_k_heads, K = q.shape
    n_v_heads, V = v.shape[2:]
    block_v = default_block_v(K, V) if block_v is None else block_v
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")

    o = torch.empty(n_seq, n_tok, n_v_heads, V, dtype=torch.float32, device=v.device)
    if o.numel() == 0:
        return o
    scale = K**-0.5 if scale is None else float(scale)
    steps = state if state_steps is None else state_steps  # never written when STORE_STEPS is off
    grid = (n_seq * n_v_heads, triton.cdiv(V, block_v))
    _gated_delta_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        steps,
        o,
        state,  # dt_bias, a, z, norm weight: read only with GATES / NORM
        state,
        state,
        state,
        n_tok,
        n_tok,
        n_v_heads,
        n_k_heads,
        K,
        V,
        scale,
        0.0,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *g.stride(),
        *beta.stride(),
        0,
        0,
        0,
        K_PAD=triton.next_power_of_2(K),
        BLOCK_V=block_v,
        STORE_STEPS=state_steps is not None,
        GATES=False,
        NORM=False,
        num_warps=4,
        **launch_options(v),
    )
    return o


def gated_norm_warps(k: int, v: int) -> int:
    """Warps of a program holding a whole [K, V] head state (`gated_delta_decode`): 64 state floats a thread, 4 to
    16 warps. At K=V=128 that is 8 warps, ~190-235 registers and no spills; 16 warps (32 floats a thread) meet the
    128-register cap of a 512-thread block and spill at T=3 on sm_80 (tests/support/gpu_compile.py)."""
    return max(4, min(16, triton.next_power_of_2(k) * triton.next_power_of_2(v) // (64 * 32)))


@on_input_device
def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    z: torch.Tensor,
    state: torch.Tensor,
    *,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    scale: float | None = None,
    state_steps: torch.Tensor | None = None,
    last_step: bool = True,
) -> torch.Tensor:
    """The recurrent rule of `gated_delta_rule_recurrent_batched` between the layer's gates and its output norm, in
    one launch: from the projections alpha and beta [B, T, Hv], the decay g = a * softplus(alpha + dt_bias) and
    beta = sigmoid(beta) (dt_bias, a [Hv]); after the recurrence, per V head, RMSNorm(o) * norm_weight *
    silu(z) (z [B, T, Hv, V], norm_weight [V], `eps` also the norm's). q, k, v, state and state_steps as in
    `gated_delta_rule_recurrent_batched`; every input may be a strided view with a contiguous last dimension.
    Returns y float32 [B, T, Hv, V]. One program per (sequence, V head) holds the head's whole state. Without
    `last_step`, state_steps[:, T - 1] is left as it was: the state after the last token is `state` itself, and a
    speculative rollback never returns to it (one state-sized write a verification less)."""
    _check_recurrent_args(q, k, v, alpha, beta, state, state_steps)
    n_seq, n_tok, n_k_heads, K = q.shape
    n_v_heads, V = v.shape[2:]
    if z.shape != v.shape or not z.dtype.is_floating_point or (z.stride(3) != 1 and V > 1):
        raise ValueError(f"z must be a float {list(v.shape)} contiguous along its last dimension, got {list(z.shape)}")
    for name, x, n in (("dt_bias", dt_bias, n_v_heads), ("a", a, n_v_heads), ("norm_weight", norm_weight, V)):
        if x.shape != (n,) or not x.dtype.is_floating_point or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float [{n}], got {x.dtype} {list(x.shape)}")
    if len({x.device for x in (v, z, dt_bias, a, norm_weight)}) != 1:
        raise ValueError("z, dt_bias, a and norm_weight must be on the inputs' device")

    y = torch.empty(n_seq, n_tok, n_v_heads, V, dtype=torch.float32, device=v.device)
    if y.numel() == 0:
        return y
    scale = K**-0.5 if scale is None else float(scale)
    block_v = triton.next_power_of_2(V)
    _gated_delta_kernel[(n_seq * n_v_heads, 1)](
        q,
        k,
        v,
        alpha,
        beta,
        state,
        state if state_steps is None else state_steps,
        y,
        dt_bias,
        a,
        z,
        norm_weight,
        n_tok,
        n_tok if last_step else n_tok - 1,
        n_v_heads,
        n_k_heads,
        K,
        V,
        scale,
        float(eps),
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *alpha.stride(),
        *beta.stride(),
        *z.stride()[:3],
        K_PAD=triton.next_power_of_2(K),
        BLOCK_V=block_v,
        STORE_STEPS=state_steps is not None,
        GATES=True,
        NORM=True,
        num_warps=gated_norm_warps(K, V),
        **launch_options(v),
    )
    return y


@triton.jit
def _gdn_glue_kernel(
    x_ptr,
    w_ptr,
    conv_ptr,
    conv_steps_ptr,
    out_ptr,
    T,
    C,
    KEY_HEADS,
    K,
    V,
    eps,
    sx_b,
    sx_t,
    W: tl.constexpr,
    W_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    STORE_STEPS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch(PDL)
    b64 = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # a head of the conv channels: the q heads, the k heads, then the v heads
    is_key = j < KEY_HEADS
    start = tl.where(is_key, j * K, KEY_HEADS * K + (j - KEY_HEADS) * V)
    offs = tl.arange(0, BLOCK)
    width = tl.where(is_key, K, V)
    ok = offs < width
    cs = start + offs
    state = conv_ptr + (b64 * C + cs) * (W - 1)  # [C, W-1] per sequence: the last W-1 inputs of each channel
    x_row = x_ptr + b64 * sx_b + cs
    out_row = out_ptr + b64 * T * C + cs
    for t in range(T):
        conv = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(W):  # input t + i of [state | new inputs] meets weight column i
            p = t + i
            # the scalar test folded into the bound (the interpreter's `vector & scalar` mask is not boolean)
            old = tl.load(state + p, mask=offs < tl.where(p < W - 1, width, 0), other=0.0)
            new = tl.load(x_row + (p - (W - 1)) * sx_t, mask=offs < tl.where(p < W - 1, 0, width), other=0.0)
            x = old + new.to(tl.float32)
            conv += x * tl.load(w_ptr + cs * W + i, mask=ok, other=0.0).to(tl.float32)
            if STORE_STEPS and i > 0:  # inputs t+1 .. t+W-1: the conv state after token t
                tl.store(conv_steps_ptr + ((b64 * T + t) * C + cs) * (W - 1) + i - 1, x, mask=ok)
        u = conv * tl.sigmoid(conv)
        norm = tl.where(is_key, 1.0 / tl.sqrt_rn(tl.sum(u * u, axis=0) + eps), 1.0)  # L2 (eps inside) of q, k
        tl.store(out_row + t * C, u * norm, mask=ok)
    # The new state, inputs T .. T+W-2, read whole before any of it is written: a small head's channels may be
    # replicated over warps, and a warp ahead must not overwrite a column another has yet to read.
    cols = tl.arange(0, W_PAD)
    p = T + cols[None, :]
    col_ok = ok[:, None] & (cols[None, :] < W - 1)
    old = tl.load(state[:, None] + p, mask=col_ok & (p < W - 1), other=0.0)
    new = tl.load(x_row[:, None] + (p - (W - 1)) * sx_t, mask=col_ok & (p >= W - 1), other=0.0).to(tl.float32)
    tl.debug_barrier()
    tl.store(state[:, None] + cols[None, :], old + new, mask=col_ok)


@on_input_device
def gdn_decode_inputs(
    mixed: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    *,
    n_k_heads: int,
    head_k: int,
    head_v: int,
    eps: float,
    conv_steps: torch.Tensor | None = None,
) -> torch.Tensor:
    """The recurrence's inputs from a Gated DeltaNet layer's qkv projection, in one launch: the causal conv over
    [conv_state | mixed] with conv_weight [C, W], SiLU, and q, k L2-normalised per head (x / sqrt(sum x^2 + eps)).
    mixed [B, T, C] = q | k | v channels (n_k_heads heads of head_k each for q and k, then v heads of head_v), any
    float dtype, strided rows allowed (contiguous last dimension). conv_state float32 [B, C, W-1], contiguous, is
    updated in place to the last W-1 inputs; with `conv_steps` (contiguous float32 [B, T, C, W-1]) the state after
    every token is written there too. Returns float32 [B, T, C]: q | k | v in mixed's channel order."""
    if mixed.dim() != 3 or conv_weight.dim() != 2 or conv_weight.shape[0] != mixed.shape[2]:
        raise ValueError(
            f"mixed must be [B, T, C] and conv_weight [C, W], got {list(mixed.shape)}, {list(conv_weight.shape)}"
        )
    n_seq, n_tok, C = mixed.shape
    W = conv_weight.shape[1]
    key_dim = 2 * n_k_heads * head_k
    if n_k_heads < 1 or head_k < 1 or head_v < 1 or C <= key_dim or (C - key_dim) % head_v or W < 2:
        raise ValueError(f"{C} channels are not 2 x {n_k_heads} heads of {head_k} and heads of {head_v} (conv {W})")
    if not mixed.dtype.is_floating_point or (mixed.stride(2) != 1 and C > 1):
        raise ValueError("mixed must be a floating-point tensor contiguous along its last dimension")
    if not conv_weight.dtype.is_floating_point or not conv_weight.is_contiguous():
        raise ValueError(f"conv_weight must be a contiguous float tensor, got {conv_weight.dtype}")
    expected = (n_seq, C, W - 1)
    if conv_state.shape != expected or conv_state.dtype != torch.float32 or not conv_state.is_contiguous():
        raise ValueError(
            f"conv_state must be contiguous float32 {list(expected)} (it is updated in place), "
            f"got {conv_state.dtype} {list(conv_state.shape)}"
        )
    if conv_steps is not None:
        expected = (n_seq, n_tok, C, W - 1)
        if conv_steps.shape != expected or conv_steps.dtype != torch.float32 or not conv_steps.is_contiguous():
            raise ValueError(f"conv_steps must be contiguous float32 {list(expected)}, got {list(conv_steps.shape)}")
    tensors = (mixed, conv_weight, conv_state) + (() if conv_steps is None else (conv_steps,))
    if len({x.device for x in tensors}) != 1:
        raise ValueError("mixed, conv_weight, conv_state and conv_steps must be on one device")

    out = torch.empty(n_seq, n_tok, C, dtype=torch.float32, device=mixed.device)
    if out.numel() == 0:
        return out
    n_heads = 2 * n_k_heads + (C - key_dim) // head_v
    _gdn_glue_kernel[(n_seq, n_heads)](
        mixed,
        conv_weight,
        conv_state,
        conv_state if conv_steps is None else conv_steps,
        out,
        n_tok,
        C,
        2 * n_k_heads,
        head_k,
        head_v,
        float(eps),
        mixed.stride(0),
        mixed.stride(1),
        W=W,
        W_PAD=triton.next_power_of_2(W - 1),
        BLOCK=triton.next_power_of_2(max(head_k, head_v)),
        STORE_STEPS=conv_steps is not None,
        num_warps=4,
        **launch_options(mixed),
    )
    return out


@triton.jit
def _chunk_scan_kernel(
    u_ptr,
    w_ptr,
    q_ptr,
    k_ptr,
    qk_ptr,
    g_ptr,
    s_ptr,
    states_ptr,
    o_ptr,
    N,
    K,
    V,
    C: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STORE_STATES: tl.constexpr,
    DOT: tl.constexpr,
):
    h = tl.program_id(0)
    h64 = h.to(tl.int64)
    HV = tl.num_programs(0)
    cs = tl.arange(0, C)
    ks = tl.arange(0, K_PAD)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < K
    v_ok = vs < V
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = ks[:, None] * V + vs[None, :]
    ck = cs[:, None] * K + ks[None, :]  # offsets inside one chunk's [C, K] block
    cv = cs[:, None] * V + vs[None, :]
    s = tl.load(s_ptr + h64 * K * V + tile, mask=tile_ok, other=0.0)  # float32 throughout; DOT only feeds tl.dot
    for n in range(N):
        chunk = h64 * N + n  # [Hv, N, ...] inputs: this head's chunk n
        g = tl.load(g_ptr + chunk * C + cs)  # cumulative log-decay inside the chunk
        g_last = tl.load(g_ptr + chunk * C + C - 1)
        s_dot = s.to(DOT)
        w = tl.load(w_ptr + chunk * C * K + ck, mask=k_ok[None, :], other=0.0)
        u = tl.load(u_ptr + chunk * C * V + cv, mask=v_ok[None, :], other=0.0)
        v_new = u - tl.dot(w.to(DOT), s_dot, input_precision="ieee")  # [C, BLOCK_V]
        v_dot = v_new.to(DOT)
        q = tl.load(q_ptr + chunk * C * K + ck, mask=k_ok[None, :], other=0.0) * tl.exp(g)[:, None]
        qk = tl.load(qk_ptr + chunk * C * C + cs[:, None] * C + cs[None, :])
        o = tl.dot(q.to(DOT), s_dot, input_precision="ieee")
        o = tl.dot(qk.to(DOT), v_dot, o, input_precision="ieee")
        tl.store(o_ptr + chunk * C * V + cv, o, mask=v_ok[None, :])
        k = tl.load(k_ptr + chunk * C * K + ck, mask=k_ok[None, :], other=0.0) * tl.exp(g_last - g)[:, None]
        s = tl.dot(tl.trans(k.to(DOT)), v_dot, tl.exp(g_last) * s, input_precision="ieee")
        if STORE_STATES:
            tl.store(states_ptr + (n * HV + h64) * K * V + tile, s, mask=tile_ok)
    tl.store(s_ptr + h64 * K * V + tile, s, mask=tile_ok)


_DOT_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Below sm_80 Triton's fp16 tl.dot at the 27B's shapes spills 2.7-10 KB a thread (tests/support/gpu_compile.py on
# sm_75); there the chunk scan stays PyTorch's loop (cuBLAS, float32), a few percent of a prompt's time.
CHUNK_SCAN_MIN_CAPABILITY = (8, 0)


def chunk_scan_supported(device: torch.device, chunk: int, k_dim: int) -> bool:
    """Whether `gated_delta_chunk_scan` takes chunks of `chunk` tokens and keys of `k_dim` (a power-of-two chunk
    of at least 16, tl.dot's smallest tile; K up to MAX_K) and runs well on `device` (CUDA from sm_80, or the
    interpreter on CPU)."""
    if chunk < 16 or chunk & (chunk - 1) or not 1 <= k_dim <= MAX_K:
        return False
    return device.type != "cuda" or cuda_capability(device) >= CHUNK_SCAN_MIN_CAPABILITY


def default_dot_dtype(device: torch.device) -> torch.dtype:
    """The chunk scan's tl.dot operand type: bf16 on CUDA (tensor cores with float32 accumulation, as the prompt
    GEMM's inputs and flash-linear-attention's chunked kernels), float32 elsewhere (the interpreter)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@on_input_device
def gated_delta_chunk_scan(
    u: torch.Tensor,
    w: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    qk: torch.Tensor,
    g_cum: torch.Tensor,
    state: torch.Tensor,
    *,
    chunk_states: torch.Tensor | None = None,
    block_v: int = 16,
    num_warps: int = 8,
    num_stages: int = 1,
    dot_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The chunk scan of the chunked gated delta rule, all float32 and contiguous, per V head h and chunk n:
    u [Hv, N, C, V] and w [Hv, N, C, K] (the solve's outputs), q [Hv, N, C, K] (scaled), k [Hv, N, C, K],
    qk [Hv, N, C, C] (Q K^T times the decay gaps, zero above the diagonal), g_cum [Hv, N, C] (cumulative
    log-decay inside each chunk). `state` [Hv, K, V] is updated in place to the state after the last chunk;
    with `chunk_states` [N, Hv, K, V] the state after every chunk is written there too. Returns o float32
    [Hv, N, C, V]. C must be a power of two >= 16 (tl.dot's smallest tile)."""
    n_v_heads, n_chunks, C, V = u.shape
    K = w.shape[-1]
    expected = {
        "w": (w, (n_v_heads, n_chunks, C, K)),
        "q": (q, (n_v_heads, n_chunks, C, K)),
        "k": (k, (n_v_heads, n_chunks, C, K)),
        "qk": (qk, (n_v_heads, n_chunks, C, C)),
        "g_cum": (g_cum, (n_v_heads, n_chunks, C)),
        "state": (state, (n_v_heads, K, V)),
    }
    if chunk_states is not None:
        expected["chunk_states"] = (chunk_states, (n_chunks, n_v_heads, K, V))
    for name, (x, shape) in {"u": (u, u.shape), **expected}.items():
        if x.shape != shape or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 {list(shape)}, got {x.dtype} {list(x.shape)}")
    if C < 16 or C & (C - 1):
        raise ValueError(f"the chunk size must be a power of two >= 16, got {C}")
    if not 1 <= K <= MAX_K or V < 1:
        raise ValueError(f"head sizes must be 1 <= K <= {MAX_K} and V >= 1, got K={K}, V={V}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if len({x.device for x, _ in expected.values()} | {u.device}) != 1:
        raise ValueError("the chunk scan's inputs and states must be on one device")
    o = torch.empty_like(u)
    if o.numel() == 0:
        return o
    if dot_dtype is None:
        dot_dtype = default_dot_dtype(u.device)
    if dot_dtype not in _DOT_TYPES:
        raise ValueError(f"dot_dtype must be one of {list(_DOT_TYPES)}, got {dot_dtype}")
    grid = (n_v_heads, triton.cdiv(V, block_v))
    _chunk_scan_kernel[grid](
        u,
        w,
        q,
        k,
        qk,
        g_cum,
        state,
        state if chunk_states is None else chunk_states,
        o,
        n_chunks,
        K,
        V,
        C=C,
        K_PAD=max(16, triton.next_power_of_2(K)),
        BLOCK_V=block_v,
        STORE_STATES=chunk_states is not None,
        DOT=_DOT_TYPES[dot_dtype],
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return o
