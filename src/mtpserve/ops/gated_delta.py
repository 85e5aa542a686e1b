"""The gated delta rule of Gated DeltaNet, token by token (decode) and chunked (prefill).

Shapes (one sequence): q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; state [Hv, K, V] float32.
q and k are L2-normalised by the caller; `scale` (default K^-0.5) multiplies q here. V head h reads q/k
head h % Hk (the "tiled" order llama.cpp's converter writes into qwen35 GGUFs). Per V head and token:

    S = exp(g_t) * S                      # decay
    S = S + k_t (x) beta_t * (v_t - S^T k_t)  # delta-rule write
    o_t = S^T (scale * q_t)               # read from the updated state

Derivation of the chunked form: ../shared/spec/qwen35-architecture.md §4.6.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import cpu as cpu_kernels
from ..quant.qtensor import QTensor
from .conv import causal_conv1d
from .decode_program import GDNBlock
from .device import gpu_path
from .linear import WeightGroup, as_rows, kernel_supports, linear, linear_many, linear_reference
from .norm import gated_rms_norm, l2_norm, rms_norm, rms_norm_for
from .quant_gemv import triton_available, triton_kernels
from .rowwise import rms_norm_quantize_reference


def _expand_heads(x: torch.Tensor, n_v_heads: int) -> torch.Tensor:
    """[T, Hk, K] -> [T, Hv, K] with V head h reading head h % Hk."""
    n_k_heads = x.shape[1]
    return x if n_k_heads == n_v_heads else x.repeat(1, n_v_heads // n_k_heads, 1)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    return_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time. Returns (o [T, Hv, V], final state), or with `return_states` the state
    after every token [T, Hv, K, V] in place of the final one (what speculative rollback restores)."""
    n_v_heads = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = _expand_heads(q.float(), n_v_heads) * scale
    k = _expand_heads(k.float(), n_v_heads)
    decay = torch.exp(g.float())
    s = state.float().clone()
    outs, states = [], []
    for t in range(q.shape[0]):
        s.mul_(decay[t, :, None, None])
        delta = beta[t, :, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], s))
        s.add_(k[t, :, :, None] * delta[:, None, :])
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
        if return_states:
            states.append(s.clone())
    o = torch.stack(outs)
    return o, (torch.stack(states) if return_states else s)


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    chunk_states: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence in chunks of `chunk_size`: same result as the recurrent form up to rounding.
    Returns (o [T, Hv, V], final state [Hv, K, V]). With a `chunk_states` list, the state after each
    whole chunk (after tokens C, 2C, ... < T) is appended to it: prompt checkpoints for free."""
    T, n_v_heads, V = v.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    C = chunk_size
    pad = -T % C
    n_chunks = (T + pad) // C

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        """[T, Hv, ...] -> [Hv, N, C, ...], zero-padded (padding has g = beta = 0: no decay, no write)."""
        x = torch.nn.functional.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.reshape(n_chunks, C, *x.shape[1:]).movedim(2, 0)

    Q = heads_first(_expand_heads(q, n_v_heads)) * scale  # [Hv, N, C, K]
    K = heads_first(_expand_heads(k, n_v_heads))
    Vv = heads_first(v)  # [Hv, N, C, V]
    B = heads_first(beta)  # [Hv, N, C]
    G = heads_first(g).cumsum(-1)  # inclusive cumulative log-decay inside each chunk

    lower_incl = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    lower_strict = lower_incl.tril(-1)
    # exp(G_i - G_j) for j <= i; masked before exp so the upper triangle cannot overflow.
    gap = (G[..., :, None] - G[..., None, :]).masked_fill(~lower_incl, float("-inf")).exp()  # [Hv, N, C, C]
    A = (B[..., :, None] * (K @ K.transpose(-1, -2)) * gap).masked_fill(~lower_strict, 0.0)
    eye = torch.eye(C, device=v.device)
    rhs = torch.cat((B[..., None] * Vv, (B * G.exp())[..., None] * K), dim=-1)  # [Hv, N, C, V + K]
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :V], UW[..., V:]
    QK = (Q @ K.transpose(-1, -2)) * gap  # [Hv, N, C, C], zero above the diagonal

    s = state.float().clone().contiguous()
    steps = torch.empty(n_chunks, *s.shape, device=s.device) if chunk_states is not None else None
    o = gated_delta_chunk_scan(U, W, Q, K, QK, G, s, chunk_states=steps)
    if chunk_states is not None and steps is not None:
        chunk_states.extend(steps[n].clone() for n in range(n_chunks) if (n + 1) * C < T)
    return o.reshape(n_v_heads, n_chunks * C, V)[:, :T].transpose(0, 1), s


def gated_delta_chunk_scan_reference(
    u: torch.Tensor,
    w: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    qk: torch.Tensor,
    g_cum: torch.Tensor,
    state: torch.Tensor,
    *,
    chunk_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sequential half of the chunked rule, chunk by chunk: u [Hv, N, C, V], w, q (scaled), k [Hv, N, C, K],
    qk [Hv, N, C, C] (Q K^T times the decay gaps, zero above the diagonal), g_cum [Hv, N, C] (cumulative
    log-decay inside each chunk). `state` float32 [Hv, K, V] is updated in place to the state after the last
    chunk; with `chunk_states` [N, Hv, K, V] the state after each chunk is written there. Returns o [Hv, N, C, V]."""
    g_last = g_cum[..., -1:]  # [Hv, N, 1]
    q_decayed = g_cum.exp()[..., None] * q
    k_tail = (g_last - g_cum).exp()[..., None] * k  # how much of each key survives to the chunk's end
    s = state
    outs = []
    for n in range(u.shape[1]):
        v_new = u[:, n] - w[:, n] @ s  # [Hv, C, V]
        outs.append(q_decayed[:, n] @ s + qk[:, n] @ v_new)
        s = g_last[:, n, :, None].exp() * s + k_tail[:, n].transpose(-1, -2) @ v_new
        if chunk_states is not None:
            chunk_states[n].copy_(s)
    state.copy_(s)
    return torch.stack(outs, dim=1)


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
) -> torch.Tensor:
    """`gated_delta_chunk_scan_reference`; on the GPU path the Triton kernel (one launch for all chunks, where
    the twin's loop costs five launches a chunk) when the chunk is a power of two >= 16 and the GPU is sm_80+."""
    kernels = triton_kernels()
    C, K = w.shape[-2:]
    if gpu_path(u) and triton_available(u) and kernels is not None and kernels.chunk_scan_supported(u.device, C, K):
        inputs = (x.contiguous() for x in (u, w, q, k, qk, g_cum))
        return kernels.gated_delta_chunk_scan(*inputs, state, chunk_states=chunk_states)
    return gated_delta_chunk_scan_reference(u, w, q, k, qk, g_cum, state, chunk_states=chunk_states)


@dataclass(frozen=True)
class GatedDeltaNetWeights:
    """One Gated DeltaNet layer past its input norm: the input projections (qkv | z | beta | alpha, read as one
    group), the decay's dt_bias and a (= -exp(A_log)), the causal conv [C, W], the gated norm and the output
    projection; n_k_heads and eps of its shapes."""

    projections: WeightGroup
    dt_bias: torch.Tensor
    a: torch.Tensor
    conv_weight: torch.Tensor
    norm_weight: torch.Tensor
    w_out: QTensor
    n_k_heads: int
    eps: float

    def __post_init__(self) -> None:
        if not isinstance(self.projections, WeightGroup):  # the C kernel reads the group's ctypes arrays
            object.__setattr__(self, "projections", WeightGroup(self.projections))
        # Decided once, not per decode call (a small model's token spends as much in such Python as in arithmetic):
        # whether the C kernels multiply every matrix (split ones shard by shard), and whether the fused mixer
        # reads them all (whole), with the float vectors it reads.
        matrices = (*self.projections, self.w_out)
        object.__setattr__(self, "on_cpu_kernels", all(kernel_supports(w, split=True) for w in matrices))
        object.__setattr__(self, "fused_on_cpu_kernels", self.projections.on_kernels and kernel_supports(self.w_out))
        floats = tuple(t.float().contiguous() for t in (self.dt_bias, self.a, self.conv_weight, self.norm_weight))
        object.__setattr__(self, "c_floats", floats)


def gated_delta_net_step_reference(
    mixed: torch.Tensor,
    z: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    conv_state: torch.Tensor,
    ssm: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    n_k_heads: int,
    eps: float,
    conv_steps: torch.Tensor | None = None,
    ssm_steps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's core for a few tokens, from the projections on: conv update, SiLU, L2-norm
    of q/k, the recurrence, gated RMSNorm. mixed [T, 2 Hk K + Hv V], z [T, Hv, V], beta/g [T, Hv].
    Returns (y [T, Hv V], new conv_state, new ssm). With `conv_steps` [T, C, W-1] and `ssm_steps` [T, Hv, K, V] the
    states after every token are written there too."""
    T = mixed.shape[0]
    n_v_heads, K, V = ssm.shape
    inputs = torch.cat((conv_state, mixed.T), dim=1)  # [C, W-1+T]: the conv state after token t is inputs t+1..
    conv, conv_state = causal_conv1d(mixed, conv_weight, conv_state)
    u = F.silu(conv)
    key_dim = n_k_heads * K
    q = l2_norm(u[:, :key_dim].view(T, n_k_heads, K), eps)
    k = l2_norm(u[:, key_dim : 2 * key_dim].view(T, n_k_heads, K), eps)
    v = u[:, 2 * key_dim :].view(T, n_v_heads, V)
    o, states = gated_delta_rule_recurrent(q, k, v, g, beta, ssm, return_states=ssm_steps is not None)
    if ssm_steps is not None:
        ssm_steps.copy_(states)
        states = states[-1]
    if conv_steps is not None:
        conv_steps.copy_(inputs.unfold(1, conv_state.shape[1], 1)[:, 1:].transpose(0, 1))
    return gated_rms_norm(o, z, norm_weight, eps).reshape(T, -1), conv_state, states


def gated_delta_net_step(
    mixed: torch.Tensor,
    z: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    conv_state: torch.Tensor,
    ssm: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    n_k_heads: int,
    eps: float,
    conv_steps: torch.Tensor | None = None,
    ssm_steps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_delta_net_step_reference` as one C kernel call (states updated in place and returned): the routine
    the fused mixer (`gated_delta_net_decode_cpu`) runs per sequence; without the library, the reference."""
    lib = cpu_kernels.load()
    if lib is None:
        return gated_delta_net_step_reference(
            mixed,
            z,
            beta,
            g,
            conv_state,
            ssm,
            conv_weight=conv_weight,
            norm_weight=norm_weight,
            n_k_heads=n_k_heads,
            eps=eps,
            conv_steps=conv_steps,
            ssm_steps=ssm_steps,
        )
    T = mixed.shape[0]
    n_v_heads, K, V = ssm.shape
    for t in (conv_state, ssm, conv_steps, ssm_steps):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError("recurrent states must be contiguous float32 (they are updated in place)")
    args = [t.float().contiguous() for t in (mixed, conv_weight, z, beta, g, norm_weight)]
    mixed, conv_weight, z, beta, g, norm_weight = args
    y = torch.empty(T, n_v_heads * V)
    lib.mtp_gdn_step(
        mixed.data_ptr(),
        conv_state.data_ptr(),
        conv_weight.data_ptr(),
        z.data_ptr(),
        beta.data_ptr(),
        g.data_ptr(),
        ssm.data_ptr(),
        norm_weight.data_ptr(),
        y.data_ptr(),
        ssm_steps.data_ptr() if ssm_steps is not None else None,
        conv_steps.data_ptr() if conv_steps is not None else None,
        T,
        n_k_heads,
        n_v_heads,
        K,
        V,
        conv_weight.shape[1],
        eps,
    )
    return y, conv_state, ssm


def gated_delta_net_decode_reference(
    h: torch.Tensor,
    weights: GatedDeltaNetWeights,
    conv_states: Sequence[torch.Tensor],
    ssms: Sequence[torch.Tensor],
    *,
    conv_steps: Sequence[torch.Tensor] | None = None,
    ssm_steps: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gated DeltaNet mixers of a few tokens for one or more sequences, in plain PyTorch, from the normed input
    h [n_seq * T, E] (sequence s owns rows s*T .. s*T + T - 1 and the states conv_states[s], ssms[s], updated in
    place): projections (qkv | z | beta | alpha), beta = sigmoid, g = a * softplus(alpha + dt_bias) (the log
    decay; a = -exp(A_log)), `gated_delta_net_step_reference`, output projection [n_seq * T, E]. With `conv_steps`
    [T, C, W-1] and `ssm_steps` [T, Hv, K, V] per sequence, the states after every token are written there too
    (a rejected draft rolls back to one of them)."""
    w = weights
    T = h.shape[0] // len(ssms)
    n_v_heads, _, V = ssms[0].shape
    mixed, z, beta, alpha = (linear_reference(h, p) for p in w.projections)
    g = w.a * F.softplus(alpha + w.dt_bias)
    beta, z = torch.sigmoid(beta), z.view(-1, n_v_heads, V)
    ys = []
    for s, (conv_state, ssm) in enumerate(zip(conv_states, ssms)):
        rows = slice(s * T, (s + 1) * T)
        y, new_conv, new_ssm = gated_delta_net_step_reference(
            mixed[rows],
            z[rows],
            beta[rows],
            g[rows],
            conv_state,
            ssm,
            conv_weight=w.conv_weight,
            norm_weight=w.norm_weight,
            n_k_heads=w.n_k_heads,
            eps=w.eps,
            conv_steps=conv_steps[s] if conv_steps is not None else None,
            ssm_steps=ssm_steps[s] if ssm_steps is not None else None,
        )
        conv_state.copy_(new_conv)
        ssm.copy_(new_ssm)
        ys.append(y)
    return linear_reference(torch.cat(ys), w.w_out)


def gated_delta_net_decode(
    h: torch.Tensor,
    weights: GatedDeltaNetWeights,
    conv_states: Sequence[torch.Tensor],
    ssms: Sequence[torch.Tensor],
    *,
    conv_steps: Sequence[torch.Tensor] | None = None,
    ssm_steps: Sequence[torch.Tensor] | None = None,
    last_step: bool = True,
) -> torch.Tensor:
    """`gated_delta_net_decode_reference`, for decode and draft verification: on the GPU path
    `gated_delta_net_decode_gpu`, else the C kernel (`gated_delta_net_decode_cpu`) where it multiplies these
    weights, else the reference. Without `last_step` the caller takes the state after the last token from the
    states themselves, and ssm_steps[s][T - 1] need not be written (the GPU path, where it is 151 MB a
    verification on the 27B, leaves it; the CPU paths write it)."""
    steps = {"conv_steps": conv_steps, "ssm_steps": ssm_steps}
    if gpu_path(h):
        return gated_delta_net_decode_gpu(h, weights, conv_states, ssms, last_step=last_step, **steps)
    if weights.on_cpu_kernels:
        return gated_delta_net_decode_cpu(h, weights, conv_states, ssms, **steps)
    return gated_delta_net_decode_reference(h, weights, conv_states, ssms, **steps)


def residual_gated_delta_net_decode(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    weights: GatedDeltaNetWeights,
    conv_states: Sequence[torch.Tensor],
    ssms: Sequence[torch.Tensor],
    *,
    conv_steps: Sequence[torch.Tensor] | None = None,
    ssm_steps: Sequence[torch.Tensor] | None = None,
    last_step: bool = True,
) -> torch.Tensor:
    """x + gated_delta_net_decode(rms_norm(x) * norm_weight, ...): a pre-norm residual mixer, one C call on the CPU
    (the norm and the add cost more in Python than in arithmetic), the composition elsewhere."""
    steps = {"conv_steps": conv_steps, "ssm_steps": ssm_steps}
    if weights.on_cpu_kernels and not gpu_path(x):
        return gated_delta_net_decode_cpu(x, weights, conv_states, ssms, residual=(norm_weight, norm_eps), **steps)
    h = rms_norm_for(x, norm_weight, norm_eps, matmul=weights.projections[0])
    return x + gated_delta_net_decode(h, weights, conv_states, ssms, last_step=last_step, **steps)


def gated_delta_net_decode_cpu(
    h: torch.Tensor,
    weights: GatedDeltaNetWeights,
    conv_states: Sequence[torch.Tensor],
    ssms: Sequence[torch.Tensor],
    *,
    conv_steps: Sequence[torch.Tensor] | None = None,
    ssm_steps: Sequence[torch.Tensor] | None = None,
    residual: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """`gated_delta_net_decode_reference` in one C call (the fused mixer), where a layer's dozen small ops would
    each cost more in Python than in arithmetic. The states must be contiguous float32 (they are updated in place);
    each sequence is rounded as if alone (see `linear`). Matrices split by rows over devices, which the fused
    kernel cannot read, go through the same kernels one call each: the same values. With `residual` (norm weight,
    eps), h is the residual stream: the result is h + mixer(rms_norm(h) * weight), all in the one call."""
    lib = cpu_kernels.load()
    assert lib is not None
    n_seq = len(ssms)
    T = h.shape[0] // n_seq
    w = weights
    if not w.fused_on_cpu_kernels:
        if residual is not None:
            normed = rms_norm(h, residual[0], residual[1])
            return h + _gated_delta_net_decode_unfused(normed, w, conv_states, ssms, conv_steps, ssm_steps)
        return _gated_delta_net_decode_unfused(h, w, conv_states, ssms, conv_steps, ssm_steps)
    n_v_heads, K, V = ssms[0].shape
    _check_states(conv_states, ssms, "recurrent states")
    x = as_rows(h)
    dt_bias, a, conv_weight, norm_weight = w.c_floats
    pointers = ctypes.c_void_p * n_seq
    conv_ptrs = pointers(*[t.data_ptr() for t in conv_states])
    ssm_ptrs = pointers(*[t.data_ptr() for t in ssms])
    steps = None, None
    if conv_steps is not None and ssm_steps is not None:
        _check_states(conv_steps, ssm_steps, "per-token state buffers")
        steps = pointers(*[t.data_ptr() for t in ssm_steps]), pointers(*[t.data_ptr() for t in conv_steps])
    out = torch.empty(x.shape[0], w.w_out.shape[0])
    fn, pre = lib.mtp_gdn_mixer, ()
    if residual is not None:
        fn, pre = lib.mtp_residual_gdn_mixer, (residual[0].data_ptr(), residual[1])
    rc = fn(
        x.data_ptr(), x.shape[0], T, x.shape[1], *pre,
        w.projections.c_types, w.projections.c_data, dt_bias.data_ptr(), a.data_ptr(),
        conv_ptrs, conv_weight.data_ptr(), ssm_ptrs, norm_weight.data_ptr(),
        w.n_k_heads, n_v_heads, K, V, conv_weight.shape[1], w.eps,
        int(w.w_out.ggml_type), w.w_out.data.data_ptr(), out.data_ptr(), *steps, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"mtp_gdn_mixer failed ({rc}) for {w.w_out.name}")
    return out


def gdn_decode_block(
    weights: GatedDeltaNetWeights, norm_weight: torch.Tensor, eps: float, conv_state: torch.Tensor, ssm: torch.Tensor
) -> GDNBlock | None:
    """The pre-norm residual mixer of one sequence (`residual_gated_delta_net_decode` for one token) in a CPU decode
    program (ops.decode_program), over that sequence's states; None where the fused kernel cannot take it."""
    w = weights
    if not w.fused_on_cpu_kernels or gpu_path(ssm):
        return None
    _check_states([conv_state], [ssm], "recurrent states")
    dt_bias, a, conv_weight, ssm_norm = w.c_floats
    n_v_heads, K, V = ssm.shape
    return GDNBlock(
        norm_w=norm_weight.data_ptr(), eps=eps, types=ctypes.addressof(w.projections.c_types),
        W=ctypes.addressof(w.projections.c_data), dt_bias=dt_bias.data_ptr(), a=a.data_ptr(),
        conv_w=conv_weight.data_ptr(), ssm_norm_w=ssm_norm.data_ptr(), conv_state=conv_state.data_ptr(),
        ssm=ssm.data_ptr(), Hk=w.n_k_heads, Hv=n_v_heads, K=K, V=V, n_conv=conv_weight.shape[1], ssm_eps=w.eps,
        t_out=int(w.w_out.ggml_type), w_out=w.w_out.data.data_ptr(),
    )  # fmt: skip


def gated_delta_net_prompt_cpu(
    h: torch.Tensor,
    weights: GatedDeltaNetWeights,
    conv_state: torch.Tensor,
    ssm: torch.Tensor,
    keep_at: Sequence[int] = (),
) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """One sequence's prompt h [T, E] through the mixer in one C call (`mtp_gdn_prompt`): the recurrence token by
    token, as llama.cpp's CPU runs its fused Gated DeltaNet for prompts too (the chunked form is the GPU path's), the
    same numbers as `gated_delta_net_decode_cpu` over the same tokens. States updated in place; also returns the
    states after each of `keep_at` tokens: {n: (conv, ssm)} (prefix-cache checkpoints). The weights must be
    `fused_on_cpu_kernels`; twin: `gated_delta_net_decode_reference`."""
    w = weights
    assert w.fused_on_cpu_kernels
    _check_states([conv_state], [ssm], "recurrent states")
    x = as_rows(h)
    n_v_heads, K, V = ssm.shape
    dt_bias, a, conv_weight, norm_weight = w.c_floats
    keep = sorted(keep_at)
    kept = {n: (torch.empty_like(conv_state), torch.empty_like(ssm)) for n in keep}
    pointers = ctypes.c_void_p * len(keep)
    out = torch.empty(x.shape[0], w.w_out.shape[0])
    rc = cpu_kernels.load().mtp_gdn_prompt(
        x.data_ptr(), x.shape[0], x.shape[1], w.projections.c_types, w.projections.c_data, dt_bias.data_ptr(),
        a.data_ptr(), conv_state.data_ptr(), conv_weight.data_ptr(), ssm.data_ptr(), norm_weight.data_ptr(),
        w.n_k_heads, n_v_heads, K, V, conv_weight.shape[1], w.eps, int(w.w_out.ggml_type), w.w_out.data.data_ptr(),
        len(keep), (ctypes.c_int64 * len(keep))(*keep), pointers(*[kept[n][0].data_ptr() for n in keep]),
        pointers(*[kept[n][1].data_ptr() for n in keep]), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"mtp_gdn_prompt failed ({rc}) for {w.w_out.name}")
    return out, kept


def _check_states(conv: Sequence[torch.Tensor], ssm: Sequence[torch.Tensor], what: str) -> None:
    for t in (*conv, *ssm):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous float32 (they are updated in place)")


def _gated_delta_net_decode_unfused(
    h: torch.Tensor,
    w: GatedDeltaNetWeights,
    conv_states: Sequence[torch.Tensor],
    ssms: Sequence[torch.Tensor],
    conv_steps: Sequence[torch.Tensor] | None,
    ssm_steps: Sequence[torch.Tensor] | None,
) -> torch.Tensor:
    """The fused mixer's steps as separate kernel calls (for matrices split by rows: `linear` multiplies each shard
    with the C kernel, whole rows the same as the fused call's)."""
    n_seq = len(ssms)
    T = h.shape[0] // n_seq
    n_v_heads, _, V = ssms[0].shape
    mixed, z, beta, alpha = linear_many(h, w.projections, T)
    beta, g = beta.float().contiguous(), alpha.float().contiguous()  # the gates in place, as the fused call
    dt_bias, a = w.c_floats[:2]
    cpu_kernels.load().mtp_gdn_gates(beta.data_ptr(), g.data_ptr(), dt_bias.data_ptr(), a.data_ptr(), *beta.shape)
    z = z.view(-1, n_v_heads, V)
    ys = []
    for s, (conv_state, ssm) in enumerate(zip(conv_states, ssms)):
        rows = slice(s * T, (s + 1) * T)
        y, _, _ = gated_delta_net_step(
            mixed[rows],
            z[rows],
            beta[rows],
            g[rows],
            conv_state,
            ssm,
            conv_weight=w.conv_weight,
            norm_weight=w.norm_weight,
            n_k_heads=w.n_k_heads,
            eps=w.eps,
            conv_steps=conv_steps[s] if conv_steps is not None else None,
            ssm_steps=ssm_steps[s] if ssm_steps is not None else None,
        )
        ys.append(y)
    return linear(torch.cat(ys), w.w_out, seq_len=T)


def gated_delta_net_decode_gpu(
    h: torch.Tensor,
    weights: GatedDeltaNetWeights,
    conv_states: Sequence[torch.Tensor],
    ssms: Sequence[torch.Tensor],
    *,
    conv_steps: Sequence[torch.Tensor] | None = None,
    ssm_steps: Sequence[torch.Tensor] | None = None,
    last_step: bool = True,
) -> torch.Tensor:
    """`gated_delta_net_decode` on the GPU path, all sequences of the batch at once, in four launches: the
    projections, `gdn_decode_inputs` (conv, SiLU, L2-norms), `gated_delta_decode` (gates, recurrence, gated norm;
    it also writes the per-token states) and the output projection. Same arguments and in-place state updates as
    `gated_delta_net_decode`: one sequence's states (and step buffers) are the kernels' own, updated where they lie
    (3 MB a layer on the 27B, never copied); several sequences' are stacked and copied back."""
    w = weights
    n_seq = len(ssms)
    T = h.shape[0] // n_seq
    n_v_heads, K, V = ssms[0].shape
    C, W = w.conv_weight.shape
    mixed, z, beta, alpha = linear_many(h, weights.projections)
    buffers = [*conv_states, *ssms, *(conv_steps or ()), *(ssm_steps or ())]
    alone = n_seq == 1 and all(t.dtype == torch.float32 and t.is_contiguous() for t in buffers)
    conv_step = ssm_step = None
    if alone:
        conv_state, state = conv_states[0][None], ssms[0][None]
        conv_step = conv_steps[0][None] if conv_steps is not None else None
        ssm_step = ssm_steps[0][None] if ssm_steps is not None else None
    else:
        conv_state, state = torch.stack(list(conv_states)).float(), torch.stack(list(ssms)).float()
        if conv_steps is not None:
            conv_step = torch.empty(n_seq, T, C, W - 1, device=state.device)
        if ssm_steps is not None:
            ssm_step = torch.empty(n_seq, T, n_v_heads, K, V, device=state.device)
    n_k_heads, eps = w.n_k_heads, w.eps
    qkv = gdn_decode_inputs(
        mixed.view(n_seq, T, C),
        w.conv_weight,
        conv_state,
        n_k_heads=n_k_heads,
        head_k=K,
        head_v=V,
        eps=eps,
        conv_steps=conv_step,
    )
    key_dim = n_k_heads * K
    y = gated_delta_decode(
        qkv[..., :key_dim].unflatten(-1, (n_k_heads, K)),
        qkv[..., key_dim : 2 * key_dim].unflatten(-1, (n_k_heads, K)),
        qkv[..., 2 * key_dim :].unflatten(-1, (n_v_heads, V)),
        alpha.view(n_seq, T, n_v_heads),
        beta.view(n_seq, T, n_v_heads),
        z.view(n_seq, T, n_v_heads, V),
        state,
        dt_bias=w.dt_bias,
        a=w.a,
        norm_weight=w.norm_weight,
        eps=eps,
        state_steps=ssm_step,
        last_step=last_step,
    )
    if not alone:
        for s in range(n_seq):
            conv_states[s].copy_(conv_state[s])
            ssms[s].copy_(state[s])
            if conv_steps is not None and conv_step is not None:
                conv_steps[s].copy_(conv_step[s])
            if ssm_steps is not None and ssm_step is not None:
                kept = T if last_step else T - 1
                ssm_steps[s][:kept].copy_(ssm_step[s][:kept])
    return linear(y.view(n_seq * T, n_v_heads * V), w.w_out)


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
    """The recurrence's q | k | v [B, T, C] from the qkv projection mixed [B, T, C]: causal conv over [conv_state |
    mixed], SiLU, L2-norms of q and k; conv_state [B, C, W-1] updated in place (and the per-token states written to
    `conv_steps` [B, T, C, W-1]). The Triton kernel (one launch) where it runs, else `gdn_decode_inputs_reference`."""
    kernels = triton_kernels()
    args = {"n_k_heads": n_k_heads, "head_k": head_k, "head_v": head_v, "eps": eps, "conv_steps": conv_steps}
    if triton_available(mixed) and kernels is not None:
        return kernels.gated_delta.gdn_decode_inputs(mixed, conv_weight.float().contiguous(), conv_state, **args)
    return gdn_decode_inputs_reference(mixed, conv_weight, conv_state, **args)


def gdn_decode_inputs_reference(
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
    """`gdn_decode_inputs` in plain PyTorch, one sequence at a time (`gated_delta_net_step_reference`'s first half)."""
    key_dim = n_k_heads * head_k
    W = conv_weight.shape[1]
    outs = []
    for b in range(mixed.shape[0]):
        x = mixed[b].float()
        conv, new_state = causal_conv1d(x, conv_weight.float(), conv_state[b])
        if conv_steps is not None:  # the state after token t: inputs t+1 .. t+W-1 of [state | new inputs]
            inputs = torch.cat((conv_state[b], x.T), dim=1)
            conv_steps[b].copy_(inputs.unfold(1, W - 1, 1)[:, 1:].transpose(0, 1))
        conv_state[b].copy_(new_state)
        u = F.silu(conv)
        q = l2_norm(u[:, :key_dim].unflatten(-1, (n_k_heads, head_k)), eps).flatten(-2)
        k = l2_norm(u[:, key_dim : 2 * key_dim].unflatten(-1, (n_k_heads, head_k)), eps).flatten(-2)
        outs.append(torch.cat((q, k, u[:, 2 * key_dim :]), dim=-1))
    return torch.stack(outs)


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
    state_steps: torch.Tensor | None = None,
    last_step: bool = True,
) -> torch.Tensor:
    """A Gated DeltaNet layer from its normalised q, k [B, T, Hk, K] and v [B, T, Hv, V] to its normed output
    y [B, T, Hv, V]: gates from the projections alpha, beta [B, T, Hv], the recurrence on state [B, Hv, K, V]
    (updated in place; per-token states to `state_steps` [B, T, Hv, K, V], all but the last token's without
    `last_step`), RMSNorm * norm_weight * silu(z). The Triton kernel (one launch) where it runs, else
    `gated_delta_decode_reference`."""
    kernels = triton_kernels()
    args = {"dt_bias": dt_bias, "a": a, "norm_weight": norm_weight, "eps": eps}
    args |= {"state_steps": state_steps, "last_step": last_step}
    if triton_available(q) and kernels is not None:
        return kernels.gated_delta.gated_delta_decode(q, k, v, alpha, beta, z, state, **args)
    return gated_delta_decode_reference(q, k, v, alpha, beta, z, state, **args)


def gated_delta_decode_reference(
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
    state_steps: torch.Tensor | None = None,
    last_step: bool = True,
) -> torch.Tensor:
    """`gated_delta_decode` in plain PyTorch, one sequence at a time: g = a * softplus(alpha + dt_bias), beta =
    sigmoid(beta), `gated_delta_rule_recurrent`, then the GPU path's RMSNorm (torch's reduction) * weight * silu(z)."""
    kept = q.shape[1] if last_step else q.shape[1] - 1
    g = a * F.softplus(alpha.float() + dt_bias)
    beta = torch.sigmoid(beta.float())
    outs = []
    for b in range(q.shape[0]):
        o, states = gated_delta_rule_recurrent(q[b], k[b], v[b], g[b], beta[b], state[b], return_states=True)
        state[b].copy_(states[-1])
        if state_steps is not None:
            state_steps[b][:kept].copy_(states[:kept])
        outs.append(o)
    o = torch.stack(outs)
    return rms_norm_quantize_reference(o, norm_weight, eps)[1] * F.silu(z.float())


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
) -> torch.Tensor:
    """The recurrent rule for a batch of sequences: q, k [B, T, Hk, K], v [B, T, Hv, V], g, beta [B, T, Hv],
    state [B, Hv, K, V] float32 updated in place; with `state_steps` [B, T, Hv, K, V] the state after every
    token is written there. Returns o [B, T, Hv, V]. The Triton kernel where it runs, else
    `gated_delta_rule_recurrent` per sequence."""
    kernels = triton_kernels()
    if triton_available(q) and kernels is not None:
        return kernels.gated_delta_rule_recurrent_batched(q, k, v, g, beta, state, scale=scale, state_steps=state_steps)
    outs = []
    for b in range(q.shape[0]):
        o, states = gated_delta_rule_recurrent(
            q[b], k[b], v[b], g[b], beta[b], state[b], scale=scale, return_states=True
        )
        state[b].copy_(states[-1])
        if state_steps is not None:
            state_steps[b].copy_(states)
        outs.append(o)
    return torch.stack(outs)
