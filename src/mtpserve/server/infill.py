"""POST /infill: code infilling (fill-in-the-middle), llama-server's endpoint for editor completion (llama.vscode,
llama.vim). The request names the code before the cursor (`input_prefix`), after it (`input_suffix`), the start of
the line being completed (`prompt`) and other files as context (`input_extra`); the answer is /completion's.

The prompt is built as llama-server builds it (`format_prompt_infill`), token for token, so that a model trained
on a FIM format sees the same input here and there. With the model's repo and file-separator tokens (Qwen2.5-Coder
and later) the extra files come in the repo-level pattern (arXiv 2409.12186):

    <FIM_REP>myproject\\n<FIM_SEP>{filename}\\n{text}...<FIM_SEP>filename\\n
    [BOS]<FIM_PRE>{prefix}{prompt}<FIM_SUF>{suffix}<FIM_MID>

without them each file's text follows "\\n\\n--- snippet ---\\n\\n". `--spm-infill` puts the suffix part before the
prefix part. The prefix keeps its last 3/4 of a logical batch (`-b`), the suffix its first 1/4 less the prompt
and two tokens, and the extra context its last n_ctx - n_batch - 2 n_predict tokens (n_predict: the server's -n),
as llama-server cuts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..tokenizer import Tokenizer
from .errors import APIError, invalid
from .params import Body, prompt_tokens

REPO_NAME = "myproject\n"  # llama-server's fixed project name (the file names are the client's)
LAST_FILE_NAME = "filename\n"  # and the name of the file being completed
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks where the model has no file separator


@dataclass(frozen=True)
class InfillLimits:
    """The server's numbers that cut an infill prompt (llama-server's flags of the same names)."""

    n_batch: int = 2048  # -b
    n_predict: int = -1  # -n
    n_ctx: int = 4096  # a slot's context
    spm: bool = False  # --spm-infill: suffix, then prefix


FIM_PARTS = {"prefix": "fim_pre", "suffix": "fim_suf", "middle": "fim_mid"}  # the tokens /infill needs


def infill_prompt(body: Body, tokenizer: Tokenizer, limits: InfillLimits) -> list[int]:
    """The token ids of an /infill request's prompt; a model without FIM tokens or a malformed field is an error
    in llama-server's words (the model first, as llama-server checks it before the body)."""
    special = tokenizer.vocab.special
    missing = "".join(f"{part} token is missing. " for part, key in FIM_PARTS.items() if special[key] is None)
    if missing:
        raise APIError(f"Infill is not supported by this model: {missing}", "not_supported_error", 501)
    _check_fields(body)
    pre, suf, mid = (special[key] for key in FIM_PARTS.values())

    def text(s: str) -> list[int]:
        return tokenizer.encode(s, add_special=False, parse_special=False)

    prefix = _mixed(body.raw("input_prefix"), tokenizer, "input_prefix")
    suffix = _mixed(body.raw("input_suffix"), tokenizer, "input_suffix")
    prompt = body.raw("prompt", "")
    tail = tokenizer.encode(prompt, add_special=False, parse_special=True) if prompt else []
    files = _extra_context(body.raw("input_extra", []), special, text)

    quarter = limits.n_batch // 4
    n_prefix = min(len(prefix), 3 * quarter)
    n_suffix = min(len(suffix), max(0, quarter - (2 + len(tail))))
    n_files = min(max(0, limits.n_ctx - limits.n_batch - 2 * limits.n_predict), len(files))
    prefix_part = [pre, *prefix[len(prefix) - n_prefix :], *tail]
    suffix_part = [suf, *suffix[:n_suffix]]
    first, second = (suffix_part, prefix_part) if limits.spm else (prefix_part, suffix_part)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    return [*files[len(files) - n_files :], *bos, *first, *second, mid]


def _check_fields(body: Body) -> None:
    if not isinstance(body.raw("prompt", ""), str):
        raise invalid('"prompt" must be a string')
    for field_name in ("input_prefix", "input_suffix"):
        if not body.has(field_name):
            raise invalid(f'"{field_name}" is required')
    extra = body.raw("input_extra", [])
    if not isinstance(extra, list):
        raise invalid('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise invalid('extra_context chunk\'s "filename" field must be a string')


def _extra_context(
    extra: list[dict[str, Any]], special: dict[str, int | None], text: Callable[[str], list[int]]
) -> list[int]:
    """The extra files' tokens, in the repo-level pattern where the model has the tokens for it."""
    rep, sep = special["fim_rep"], special["fim_sep"]
    out: list[int] = [rep, *text(REPO_NAME)] if rep is not None else []
    for chunk in extra:
        if sep is not None:
            out += [sep, *text(chunk.get("filename", "tmp") + "\n")]
        else:
            out += text(SNIPPET_SEPARATOR)
        out += text(chunk["text"])
    if sep is not None:
        out += [sep, *text(LAST_FILE_NAME)]
    return out


def _mixed(value: Any, tokenizer: Tokenizer, field_name: str) -> list[int]:
    """input_prefix / input_suffix: a string or an array of token ids and strings, special tokens not parsed."""
    return [] if value == [] else prompt_tokens(value, tokenizer, field_name, special=False)
