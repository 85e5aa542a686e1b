"""Where llama-server ends a prompt's batches, as the parity tests and bench/numerics_vs_llama.py feed llama.cpp's
references: models whose cache cannot be rolled back (recurrent state, sliding windows) have their prompt stopped at
the last user message and 4 tokens before the end, where it keeps checkpoints. Batch ends change float rounding.
Written from llama-server's behaviour, apart from the engine's own schedule (engine.slots), which tests hold to it."""

from __future__ import annotations

CHECKPOINT_TAIL = 4  # llama-server: the last 4 prompt tokens go in a batch of their own
UBATCH = 512


def needs_checkpoints(model) -> bool:  # noqa: ANN001 - any loaded model
    """Recurrent layers or sliding-window layers: llama-server splits the prompt for checkpoints."""
    kinds = model.config.layer_kinds()
    return "gated_deltanet" in kinds or "sliding_attention" in kinds


def server_prompt_batches(n: int, user_start: int | None, checkpoints: bool) -> list[int]:
    """End positions of llama-server's prompt batches."""
    ends = {n}
    if checkpoints:
        for cut in (user_start, n - CHECKPOINT_TAIL - UBATCH, n - CHECKPOINT_TAIL):
            if cut is not None and 0 < cut < n:
                ends.add(cut)
    return sorted(ends)
