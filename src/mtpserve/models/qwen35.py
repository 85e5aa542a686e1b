"""Qwen3.5 / Qwen3.6 dense hybrid (`qwen35`): Gated DeltaNet and gated full-attention layers, plus an
MTP (NextN) block that drafts the token after next.

Semantics: ../shared/spec/qwen35-architecture.md (read from llama.cpp's qwen35 graph).
"""

from __future__ import annotations

from collections.abc import Collection
from ctypes import Structure
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..cache import KVCache, RecurrentState
from ..cache.kv import rope_append_and_attend
from ..ops.activations import ResidualGatedFFN, sigmoid_gate_for, swiglu_ffn
from ..ops.conv import causal_conv1d
from ..ops.decode_program import DraftModel, DrawnChain, run_draft_chain, run_programs
from ..ops.device import gpu_path
from ..ops.embedding import embedding
from ..ops.gated_delta import (
    GatedDeltaNetWeights,
    gated_delta_net_decode,
    gated_delta_net_prompt_cpu,
    gated_delta_rule_chunked,
    gdn_decode_block,
    residual_gated_delta_net_decode,
)
from ..ops.linear import WeightGroup, kernel_supports, linear, linear_many
from ..ops.linear_gpu import QuantizedRows
from ..ops.norm import add_rms_norm_for, gated_rms_norm, l2_norm, rms_norm, rms_norm_for
from ..ops.rope import RopeTable
from ..quant.qtensor import QTensor
from .base import Batch, CausalLM, ModelState, Rope, SharedKV, WeightStore, new_kv_caches, padded_context
from .configs.qwen35 import ARCH, Qwen35Config  # noqa: F401 (re-exported)
from .tensor_parallel import attention_share, deltanet_share, ffn_share, vocab_share

# --- blocks -------------------------------------------------------------------------------------------


class GatedAttention:
    """Full attention whose output is gated per channel by sigmoid of a second query projection;
    per-head RMSNorm on q and k before partial RoPE."""

    def __init__(self, w: WeightStore, b: str, c: Qwen35Config) -> None:
        hd, wo = c.head_dim, f"{b}.attn_output.weight"
        share = attention_share(w.partition, c.n_head, c.n_head_kv, hd, w.ggml_type(wo))  # a rank's heads
        self.c = c = replace(c, n_head=len(share.heads), n_head_kv=len(share.kv_heads))
        self.wq = w.matrix(f"{b}.attn_q.weight", rows=share.q_rows(2 * hd))  # joint query + gate, [H, 2, hd] a token
        self.wk = w.matrix(f"{b}.attn_k.weight", rows=share.kv_rows(hd))
        self.wv = w.matrix(f"{b}.attn_v.weight", rows=share.kv_rows(hd))
        self.qkv = WeightGroup((self.wq, self.wk, self.wv))  # one kernel call for the three
        self.input_weight = self.wq  # the first matmul of the block's input
        self.wo = w.matrix(wo, columns=share.out_columns(hd), partition=share.partition)
        self.q_norm = w.dense(f"{b}.attn_q_norm.weight")
        self.k_norm = w.dense(f"{b}.attn_k_norm.weight")
        # the block's one-call form (KVCache.residual_attention, decode_block): the output gated by a second query
        self.fused = {"qkv": self.qkv, "wo": self.wo, "n_heads": c.n_head, "scale": c.head_dim**-0.5}
        self.fused |= {"q_norm": self.q_norm, "k_norm": self.k_norm, "q_gated": True, "neox": True}

    def __call__(self, x: torch.Tensor, rope: Rope, caches: list[KVCache], seq_len: int) -> torch.Tensor:
        c, T = self.c, x.shape[0]
        qg, k, v = linear_many(x, self.qkv, seq_len)
        qg = qg.view(T, c.n_head, 2, c.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1]  # gate [T, H, hd]: heads strided, read in place
        k, v = k.view(T, c.n_head_kv, c.head_dim), v.view(T, c.n_head_kv, c.head_dim)
        # q/k norms, RoPE and the cache write: one launch per cache on the GPU path
        norms = {"q_norm": self.q_norm, "k_norm": self.k_norm, "eps": c.rms_eps}
        o = rope_append_and_attend(
            caches, q, k, v, rope.positions, rope.cos, rope.sin, c.head_dim**-0.5, rope.static, **norms
        ).reshape(T, -1)
        return linear(sigmoid_gate_for(o, gate, matmul=self.wo), self.wo, seq_len=seq_len)

    def residual(
        self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, rope: Rope, caches: list[KVCache], seq_len: int
    ) -> torch.Tensor:
        """x + self(rms_norm(x) * norm_weight): one C call for a few tokens of one sequence on the CPU
        (`KVCache.residual_attention`), op by op elsewhere."""
        if len(caches) == 1 and not rope.static:
            y = caches[0].residual_attention(x, norm_weight, eps, cos=rope.cos, sin=rope.sin, **self.fused)
            if y is not None:
                return y
        return x + self(rms_norm(x, norm_weight, eps), rope, caches, seq_len)


class GatedDeltaNet:
    """Linear attention with a gated delta-rule state: projections, short causal conv, L2-normed q/k,
    the recurrence, and a gated RMSNorm on the output."""

    def __init__(self, w: WeightStore, b: str, c: Qwen35Config) -> None:
        d, out = c.ssm_head_dim, f"{b}.ssm_out.weight"
        share = deltanet_share(w.partition, c.n_k_heads, c.n_v_heads, d, w.ggml_type(out))  # a rank's heads
        channels, heads = share.qkv_rows(d, c.key_dim), share.v_runs(1)  # conv channels; per-V-head rows
        self.c = c = replace(c, n_k_heads=len(share.k_heads), n_v_heads=len(share.v_heads))
        qkv = w.matrix(f"{b}.attn_qkv.weight", rows=channels)  # q | k | v rows, V heads in tiled order
        gate = w.matrix(f"{b}.attn_gate.weight", rows=share.v_runs(d))  # z
        beta, alpha = (w.matrix(f"{b}.ssm_{n}.weight", rows=heads) for n in ("beta", "alpha"))
        self.w = GatedDeltaNetWeights(
            projections=WeightGroup((qkv, gate, beta, alpha)),
            dt_bias=w.dense(f"{b}.ssm_dt.bias", rows=heads),
            a=w.dense(f"{b}.ssm_a", rows=heads),  # already -exp(A_log)
            conv_weight=w.dense(f"{b}.ssm_conv1d.weight", rows=channels),  # [conv_dim, d_conv]
            norm_weight=w.dense(f"{b}.ssm_norm.weight"),
            w_out=w.matrix(out, columns=share.v_runs(d), partition=share.partition),
            n_k_heads=c.n_k_heads,
            eps=c.rms_eps,
        )
        self.input_weight = qkv  # the first matmul of the block's input

    def __call__(
        self,
        x: torch.Tensor,
        states: list[RecurrentState],
        seq_len: int,
        keep_at: Collection[int] = (),
        steps: list[list[RecurrentState]] | None = None,
    ) -> tuple[torch.Tensor, dict[int, RecurrentState]]:
        """Output [rows, E], and (one sequence, chunked path) its states after `keep_at` tokens of this
        batch (multiples of the chunk size): {tokens into the batch: state}. With `steps` (up to
        RECURRENT_MAX_TOKENS tokens), the states after every token are appended there, per sequence."""
        c = self.c
        kept: dict[int, RecurrentState] = {}
        if seq_len <= RECURRENT_MAX_TOKENS:  # decode, draft verification: the whole mixer in one kernel call
            return self.decode(x, states, seq_len, steps), kept
        if steps is not None:
            raise ValueError(f"per-token states are kept for up to {RECURRENT_MAX_TOKENS} tokens, not {seq_len}")
        w = self.w
        if w.fused_on_cpu_kernels and not gpu_path(x):  # CPU prompts: token by token in C, as llama.cpp's CPU does
            outs = []
            for s, state in enumerate(states):
                rows = slice(s * seq_len, (s + 1) * seq_len)
                out, kept_states = gated_delta_net_prompt_cpu(x[rows], w, state.conv, state.ssm, keep_at)
                kept |= {n: RecurrentState(conv, ssm) for n, (conv, ssm) in kept_states.items()}
                outs.append(out)
            return torch.cat(outs), kept
        mixed, z, beta, alpha = linear_many(x, w.projections, seq_len)  # mixed: [T, conv_dim]
        z = z.view(-1, c.n_v_heads, c.ssm_head_dim)
        beta = torch.sigmoid(beta)  # [T, Hv]
        g = w.a * F.softplus(alpha + w.dt_bias)  # log of the per-step decay
        outs = []
        for s, state in enumerate(states):  # the chunked rule, one prompt at a time
            rows = slice(s * seq_len, (s + 1) * seq_len)
            conv, new_conv = causal_conv1d(mixed[rows], w.conv_weight, state.conv)
            u = F.silu(conv)
            q = l2_norm(u[:, : c.key_dim].view(seq_len, c.n_k_heads, c.ssm_head_dim), c.rms_eps)
            k = l2_norm(u[:, c.key_dim : 2 * c.key_dim].view(seq_len, c.n_k_heads, c.ssm_head_dim), c.rms_eps)
            v = u[:, 2 * c.key_dim :].view(seq_len, c.n_v_heads, c.ssm_head_dim)
            chunk_states: list[torch.Tensor] | None = [] if keep_at else None
            o, new_ssm = gated_delta_rule_chunked(
                q, k, v, g[rows], beta[rows], state.ssm, chunk_size=GDN_CHUNK, chunk_states=chunk_states
            )
            if keep_at:
                inputs = torch.cat((state.conv, mixed[rows].T), dim=1)  # conv state after n tokens: inputs n-W+1..n
                for i, ssm in enumerate(chunk_states or []):
                    n = (i + 1) * GDN_CHUNK
                    if n in keep_at:
                        kept[n] = RecurrentState(inputs[:, n : n + c.d_conv - 1].clone(), ssm)
            state.conv.copy_(new_conv)  # in place: the state's tensors are the slot's memory
            state.ssm.copy_(new_ssm)
            outs.append(gated_rms_norm(o, z[rows], w.norm_weight, c.rms_eps).reshape(seq_len, -1))
        return linear(torch.cat(outs), w.w_out, seq_len=seq_len), kept

    def decode(
        self,
        x: torch.Tensor,
        states: list[RecurrentState],
        seq_len: int,
        steps: list[list[RecurrentState]] | None,
        pre_norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """The mixer for up to RECURRENT_MAX_TOKENS tokens a sequence, in one kernel call. With `pre_norm` (weight,
        eps), x is the residual stream and the result x + mixer(rms_norm(x)), still one call (the CPU decode)."""
        conv_steps = ssm_steps = None
        if steps is not None:
            conv_steps = [torch.empty(seq_len, *st.conv.shape, device=st.conv.device) for st in states]
            ssm_steps = [torch.empty(seq_len, *st.ssm.shape, device=st.ssm.device) for st in states]
        conv_states, ssms = [st.conv for st in states], [st.ssm for st in states]
        # the state after the last token is the state itself, updated in place: no step buffer need hold it
        kept_steps = {"conv_steps": conv_steps, "ssm_steps": ssm_steps, "last_step": False}
        if pre_norm is None:
            out = gated_delta_net_decode(x, self.w, conv_states, ssms, **kept_steps)
        else:
            out = residual_gated_delta_net_decode(x, *pre_norm, self.w, conv_states, ssms, **kept_steps)
        if steps is not None and conv_steps is not None and ssm_steps is not None:
            steps.extend(
                [RecurrentState(cs[t], ss[t]) for t in range(seq_len - 1)] + [state]
                for cs, ss, state in zip(conv_steps, ssm_steps, states)
            )
        return out


class SwiGLU:
    def __init__(self, w: WeightStore, b: str) -> None:
        down = f"{b}.ffn_down.weight"
        share = ffn_share(w.partition, w.shape(down)[1], w.ggml_type(down))  # a rank's columns of the FFN
        self.gate = w.matrix(f"{b}.ffn_gate.weight", rows=share.columns)
        self.up = w.matrix(f"{b}.ffn_up.weight", rows=share.columns)
        self.gate_up = WeightGroup((self.gate, self.up))  # one GEMV launch on the GPU path
        self.down = w.matrix(down, columns=share.columns, partition=share.partition)

    def __call__(
        self, x: torch.Tensor | QuantizedRows, seq_len: int, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        return swiglu_ffn(x, self.gate, self.up, self.down, seq_len, gate_up=self.gate_up, residual=residual)


class DecoderLayer:
    """Pre-norm block: x + mixer(norm(x)), then + FFN(norm(x)); the mixer is Gated DeltaNet or gated
    attention. (`post_attention_norm` is the pre-FFN norm here.)"""

    def __init__(self, w: WeightStore, i: int, c: Qwen35Config) -> None:
        b = f"blk.{i}"
        self.index, self.eps = i, c.rms_eps
        self.recurrent = c.recurrent[i]
        self.attn_norm = w.dense(f"{b}.attn_norm.weight")
        self.mixer = GatedDeltaNet(w, b, c) if self.recurrent else GatedAttention(w, b, c)
        self.ffn_norm = w.dense(f"{b}.post_attention_norm.weight")
        self.ffn = SwiGLU(w, b)
        self.residual_ffn = ResidualGatedFFN(self.ffn_norm, self.eps, self.ffn.gate_up, self.ffn.down)

    def __call__(self, x: torch.Tensor, rope: Rope, batch: Batch) -> torch.Tensor:
        if batch.n_tokens <= RECURRENT_MAX_TOKENS and not gpu_path(x):
            return self.cpu_decode(x, rope, batch)
        # On the GPU path the norms hand their matmuls quantized rows (ops.norm.rms_norm_for); on the CPU, floats.
        h = rms_norm_for(x, self.attn_norm, self.eps, matmul=self.mixer.input_weight)
        if self.recurrent:
            states = [state.recurrent[self.index] for state in batch.states]
            steps = batch.steps.setdefault(self.index, []) if batch.keep_steps else None
            out, kept = self.mixer(h, states, batch.n_tokens, batch.checkpoint_offsets(GDN_CHUNK), steps)
            for n, snapshot in kept.items():
                batch.checkpoints.setdefault(batch.starts[0] + n, {})[self.index] = snapshot
        else:
            out = self.mixer(h, rope, [state.kv[self.index] for state in batch.states], batch.n_tokens)
        if not gpu_path(x):
            return self.residual_ffn(x + out, batch.n_tokens)
        x, h = add_rms_norm_for(x, out, self.ffn_norm, self.eps, matmul=self.ffn.gate)  # x + out, normed
        return self.ffn(h, batch.n_tokens, residual=x)  # x + FFN(h), the add in the down projection's launch

    def cpu_decode(self, x: torch.Tensor, rope: Rope, batch: Batch) -> torch.Tensor:
        """The block for a few tokens on the CPU: each half (norm, mixer or FFN, residual add) one C call where it
        can be, the same numbers as the ops one by one."""
        if isinstance(self.mixer, GatedDeltaNet):
            states = [state.recurrent[self.index] for state in batch.states]
            steps = batch.steps.setdefault(self.index, []) if batch.keep_steps else None
            x = self.mixer.decode(x, states, batch.n_tokens, steps, pre_norm=(self.attn_norm, self.eps))
        else:
            caches = [state.kv[self.index] for state in batch.states]
            x = self.mixer.residual(x, self.attn_norm, self.eps, rope, caches, batch.n_tokens)
        return self.residual_ffn(x, batch.n_tokens)

    def decode_blocks(self, state: ModelState) -> list[Structure] | None:
        """The block's two halves in a CPU decode program over `state` (ops.decode_program), or None."""
        if isinstance(self.mixer, GatedDeltaNet):
            rs = state.recurrent[self.index]
            mixer = gdn_decode_block(self.mixer.w, self.attn_norm, self.eps, rs.conv, rs.ssm)
        else:
            mixer = state.kv[self.index].decode_block(self.attn_norm, self.eps, **self.mixer.fused)
        ffn = self.residual_ffn.decode_block()
        return None if mixer is None or ffn is None else [mixer, ffn]


class MTPHead:
    """The NextN block: from the embedding of token x_p and the trunk's final hidden state at p-1, one
    attention block (with its own KV cache) predicts the token at p+1."""

    def __init__(self, w: WeightStore, i: int, c: Qwen35Config, output: QTensor, output_norm: torch.Tensor) -> None:
        b = f"blk.{i}.nextn"
        self.c = c
        self.eh_proj = w.matrix(f"{b}.eh_proj.weight")  # columns: [embedding | hidden]
        self.enorm = w.dense(f"{b}.enorm.weight")
        self.hnorm = w.dense(f"{b}.hnorm.weight")
        self.embed = w.matrix(f"{b}.embed_tokens.weight") if w.has(f"{b}.embed_tokens.weight") else None
        self.norm = w.dense(f"{b}.shared_head_norm.weight") if w.has(f"{b}.shared_head_norm.weight") else output_norm
        head = f"{b}.shared_head_head.weight"  # its own LM head (a tensor-parallel rank's rows), or the trunk's
        self.head = w.matrix(head, **vocab_share(w.partition, c.n_vocab)) if w.has(head) else output
        self.block = DecoderLayer(w, i, c)


# --- model --------------------------------------------------------------------------------------------


RECURRENT_MAX_TOKENS = 8  # up to this many tokens (decode, draft verification) the step-by-step rule wins
GDN_CHUNK = 64  # the chunked rule's chunk size (gated_delta_rule_chunked's default)


class Qwen35ForCausalLM(CausalLM):
    def __init__(self, w: WeightStore, config: Qwen35Config) -> None:
        c = self.config = config
        self._place(w)
        self.token_embd = w.matrix("token_embd.weight")
        self.layers = [DecoderLayer(w, i, c) for i in range(c.n_layer)]
        self.output_norm = w.dense("output_norm.weight")
        self.output = self._output_layer(w)
        self.mtp = [MTPHead(w, i, c, self.output, self.output_norm) for i in c.mtp_layers()]
        attention = [layer for layer in (*self.layers, *(m.block for m in self.mtp)) if not layer.recurrent]
        self.kv_heads = {layer.index: layer.mixer.c.n_head_kv for layer in attention if w.partition.split}
        self.rope_table = RopeTable(c.n_rot, c.rope_base, sections=c.rope_sections, device=self.device)
        self._draft_models: dict[tuple[int, int], DraftModel] = {}  # mtp_draft's, by draft head

    def new_state(
        self,
        ctx_size: int = 0,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        mtp: bool = False,
        *,
        shared: SharedKV | None = None,
    ) -> ModelState:
        """`mtp` also allocates the MTP block's KV cache (kept in `state.kv` under the block's index)."""
        c = self.config
        ctx = padded_context(ctx_size, c)
        local = {layer.index: layer.mixer.c for layer in self.layers}  # a tensor-parallel rank's heads
        recurrent = {
            i: RecurrentState.zeros(lc.conv_dim, lc.d_conv, lc.n_v_heads, lc.ssm_head_dim, self.device_of(i))
            for i, lc in local.items()
            if c.recurrent[i]
        }
        where = {"devices": self._layer_device_map(), "shared": shared, "kv_heads": self.kv_heads}
        kv = new_kv_caches(c, ctx, cache_type_k, cache_type_v, **where)
        if mtp:
            if not self.mtp:
                raise ValueError("this model has no MTP block (nextn_predict_layers = 0)")
            kv.update(new_kv_caches(c, ctx, cache_type_k, cache_type_v, mtp=True, **where))
        return ModelState(kv, recurrent, capacity=ctx)

    @torch.inference_mode()
    def mtp_step(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        state: ModelState,
        with_logits: bool = True,
        positions: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """MTP rows for tokens [T] at the next positions of the MTP cache, each fed the hidden state [T, E]
        that predicted its token (the trunk's final-norm output at the previous position, or for chained
        drafts the MTP's own output). Returns (logits [T, V] on the CPU for the token after each, or None without
        `with_logits` (a catch-up pass only writes the cache), h_mtp [T, E]). With `positions` (a device tensor:
        a captured step, models.graphs) the rows go to those positions and the cache's length is the caller's to
        advance; `embeddings` [T, E]: the tokens' rows, looked up already (`mtp_embed`)."""
        head = self.mtp[0]
        c, kv = self.config, state.kv[head.block.index]
        device = self.device_of(head.block.index)
        e = (self.mtp_embed(tokens) if embeddings is None else embeddings).to(device)
        hidden = hidden.to(device)
        u = linear(
            torch.cat((rms_norm(e, head.enorm, c.rms_eps), rms_norm(hidden, head.hnorm, c.rms_eps)), -1), head.eh_proj
        )
        start = kv.length if positions is None else -1  # MTP positions follow its own cache
        program = None if positions is not None or gpu_path(u) else self.program_over(state, "mtp", [head.block])
        if program is not None and program.ready(start, len(tokens)):  # one C call, the block's numbers
            run_programs([program], u, [start], [[self.rope_table.span(start, len(tokens))]])
        else:
            batch = Batch(tokens, [state], len(tokens), [start], positions=positions)
            u = head.block(u, batch.rope(self.rope_table).to(device), batch)
        h_mtp = rms_norm(u, head.norm, c.rms_eps)
        if not with_logits:
            return None, h_mtp
        return linear(h_mtp.to(head.head.data.device), head.head).cpu(), h_mtp

    def mtp_draft(
        self,
        hidden: torch.Tensor,
        tokens: list[int],
        state: ModelState,
        n_steps: int,
        head: QTensor,
        top_k: int,
        p_min: float,
        draws: DrawnChain | None = None,
    ) -> list[tuple[int, float]] | None:
        """`n_steps` chained greedy drafts in one C call on the CPU (ops.decode_program.run_draft_chain): step 0 over
        `tokens` with `hidden` (as `mtp_step`), each later step over the previous draft and the block's own output;
        (argmax of `head`'s row, its softmax over the top `top_k`) per step, stopping after the first below p_min.
        The steps' rows stay in the MTP cache, its length past them. None where the chain cannot serve (a GPU, a
        block or weight the kernels lack, a full cache): `mtp_step` one step at a time then does. With `draws` each
        step's token is drawn from the request's chain (the p stays the argmax's)."""
        return self._draft_chain(hidden, tokens, state, n_steps, head, top_k, p_min, draws=draws)

    def mtp_draft_row(
        self, hidden: torch.Tensor, tokens: list[int], state: ModelState, head: QTensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """One draft step in one C call on the CPU, as `mtp_draft`'s first: (`head`'s row [V], the block's output
        [1, E] (the next step's input), the argmax's softmax over the top `top_k`), for a draft token drawn on the
        host; None where the chain cannot serve."""
        row, out = torch.empty(head.shape[0]), torch.empty(1, self.config.n_embd)
        chain = self._draft_chain(hidden, tokens, state, 1, head, top_k, 0.0, row, out)
        return None if chain is None else (row, out, chain[0][1])

    def _draft_chain(
        self,
        hidden: torch.Tensor,
        tokens: list[int],
        state: ModelState,
        n_steps: int,
        head: QTensor,
        top_k: int,
        p_min: float,
        out_row: torch.Tensor | None = None,
        out_hidden: torch.Tensor | None = None,
        draws: DrawnChain | None = None,
    ) -> list[tuple[int, float]] | None:
        block = self.mtp[0]
        start = state.kv[block.block.index].length
        program = None if gpu_path(self.output_norm) else self.program_over(state, "mtp", [block.block])
        end = start + len(tokens) + n_steps - 1
        if program is None or n_steps < 1 or not program.ready(start, len(tokens)) or end > program.capacity:
            return None
        if not all(kernel_supports(w) for w in (self.mtp_table, block.eh_proj, head)):
            return None
        spans = lambda position, n: [self.rope_table.span(position, n)]  # noqa: E731
        model = self._draft_model(head)
        outs = (out_row, out_hidden, draws)
        return run_draft_chain(model, program, hidden, tokens, start, n_steps, spans, top_k, p_min, *outs)

    def _draft_model(self, head: QTensor) -> DraftModel:
        """The chain's constant arguments for this draft head (the MTP head, or its first rows), made once."""
        key = (head.data.data_ptr(), head.shape[0])
        if key not in self._draft_models:
            block, table, c = self.mtp[0], self.mtp_table, self.config
            self._draft_models[key] = DraftModel(
                int(table.ggml_type), table.data.data_ptr(), table.shape[0], block.enorm.data_ptr(),
                block.hnorm.data_ptr(), block.norm.data_ptr(), c.rms_eps, int(block.eh_proj.ggml_type),
                block.eh_proj.data.data_ptr(), None, 0, int(head.ggml_type), head.data.data_ptr(), head.shape[0],
                c.n_embd,
            )  # fmt: skip
        return self._draft_models[key]

    def mtp_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The MTP block's token rows: its own table, or the trunk's."""
        return embedding(self.mtp_table, tokens)

    @property
    def mtp_head(self) -> QTensor:
        return self.mtp[0].head

    @property
    def mtp_table(self) -> QTensor:
        return self.mtp[0].embed or self.token_embd

    @property
    def mtp_kv_index(self) -> int | None:
        """Where `new_state(mtp=True)` keeps the MTP block's KV cache in `state.kv` (None: no MTP block)."""
        return self.mtp[0].block.index if self.mtp else None
