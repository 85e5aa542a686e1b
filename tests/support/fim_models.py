"""tinyqwen35 given fill-in-the-middle tokens, for /infill (server/infill.py): none of the fixture models has FIM
tokens, so llama-server and mtpserve both refuse /infill on them. These copies name five of the model's control
tokens as FIM tokens in the metadata keys llama.cpp reads (`tokenizer.ggml.fim_*_token_id`); the weights are the
fixture's byte for byte. The model was not trained on FIM, so what it writes means nothing; what is compared with
llama-server is the prompt each builds and the tokens greedy decoding gives for it.

- "fim": prefix, suffix and middle tokens only: extra files follow the "--- snippet ---" separator;
- "fim_repo": also the repo and file-separator tokens: the repo-level pattern (Qwen2.5-Coder's).
"""

from __future__ import annotations

from pathlib import Path

from ..conftest import tinyqwen_path
from .ggufgen import with_metadata

KEY = "tokenizer.ggml.{}_token_id"
# <think>, </think>, <|im_start|>; then <|endoftext|> and <|im_end|> as repo and file separator
FIM_VARIANTS = {
    "fim": {"fim_pre": 4094, "fim_suf": 4095, "fim_mid": 4092},
    "fim_repo": {"fim_pre": 4094, "fim_suf": 4095, "fim_mid": 4092, "fim_rep": 4091, "fim_sep": 4093},
}


def fim_model(variant: str, directory: Path) -> Path:
    """tinyqwen35 Q4_K_M with `variant`'s FIM tokens, written under `directory` (once)."""
    path = directory / f"tinyqwen35-{variant}-Q4_K_M.gguf"
    if not path.exists():
        ids = {KEY.format(name): token for name, token in FIM_VARIANTS[variant].items()}
        with_metadata(tinyqwen_path("Q4_K_M"), path, ids)
    return path
