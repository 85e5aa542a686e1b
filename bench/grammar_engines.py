"""xgrammar against llguidance on the deployment's vocabulary size: schema compile time and token-mask time.

    .venv/bin/python bench/grammar_engines.py [--json OUT] [--tokens 200]

The vocabulary: tinyqwen35's 4,096 tokens (qwen35's byte-level BPE pieces and its control tokens), padded to the
27B's 248,320 with real sub-word pieces (Gemma 3's vocabulary, duplicates skipped), so that the token trie the
engines walk has the size and shape of a real one; also SmolLM2's own 49,152. Both engines get the same byte
strings per token and the same end-of-generation ids.

Per engine and grammar:
* compile_ms: from the grammar text to a matcher able to give its first mask (xgrammar compiles ahead;
  llguidance builds its lexer lazily, so its first mask is counted in);
* mask_ms: mean and p99 time to fill the next-token bitmask, over the tokens of a document the grammar accepts
  (the document tokenized by mtpserve's tokenizer and fed token by token, each one accepted after its mask);
* cached_ms: compiling the same grammar again (the engine's own cache, if any; mtpserve caches by content hash
  on top).

Then, per CPU model (SmolLM2, Gemma 3, tinyqwen35; 2 threads), what a constraint costs a real decode: the same
greedy request run through mtpserve's engine with and without the schema (`n_predict` tokens, forced to go on
with ignore_eos where the grammar allows), reported as ms per token both ways and the share of a decode step
the constraint adds (mask, its application, the matcher's bookkeeping; the next mask is filled while the
forward pass runs), medians of REPEATS alternating runs. A step's masks at 248,320 tokens are the first table's mask_ms.

The grammars: a nested JSON schema (objects, arrays, enums, bounded numbers; the one the server tests use), an
arithmetic-expression GBNF grammar, and (xgrammar only: its qwen_3_5 preset) Qwen's XML tool-call format with
the reasoning block before it. Single-threaded masks (one request's matcher); 2 compile threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mtpserve.default_models import GEMMA3, SMOLLM2, model_path
from mtpserve.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
DEPLOYMENT_VOCAB = 248_320
REPEATS = 5  # alternating plain / constrained runs per model in the share measurement (medians kept)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "admin",
        "scores": [0.5, 0.25, 1],
        "address": {"city": "London", "zip": "12345"},
    }
)
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
EXPRESSION = "(12+3)*4-(5/6+78)*9"


def vocabulary(base: Tokenizer, size: int, filler: Tokenizer | None) -> list[bytes]:
    """`base`'s token bytes (control tokens as their text), padded to `size` with `filler`'s distinct pieces."""
    tokens = [base.token_bytes(i) for i in range(base.n_vocab)]
    if filler is None or size <= len(tokens):
        return tokens
    seen = set(tokens)
    for i in range(filler.n_vocab):
        piece = filler.token_bytes(i, special=False)
        if piece and piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            if len(tokens) == size:
                break
    return tokens


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokens: list[bytes], eog: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=eog)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.bitmask = xgrammar.allocate_token_bitmask(1, len(tokens))

    def matcher(self, kind: str, source: str):  # noqa: ANN201 - the engine's own type
        if kind == "json":
            compiled = self.compiler.compile_json_schema(source)
        elif kind == "gbnf":
            compiled = self.compiler.compile_grammar(source)
        else:
            compiled = self.compiler.compile_structural_tag(source)
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher) -> None:  # noqa: ANN001
        matcher.fill_next_token_bitmask(self.bitmask)

    def allows(self, token: int) -> bool:
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def accept(self, matcher, token: int) -> bool:  # noqa: ANN001
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokens: list[bytes], eog: list[int], encode) -> None:  # noqa: ANN001
        import llguidance
        import llguidance.torch

        class Vocab:
            eos_token_id, bos_token_id = eog[0], None
            special_token_ids: list[int] = []

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: bytes) -> list[int]:
                return encode(text.decode("utf-8", errors="replace"))

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()), eos_token=eog)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, len(tokens))
        self.fill = llguidance.torch.fill_next_token_bitmask

    def matcher(self, kind: str, source: str):  # noqa: ANN201
        if kind == "json":
            grammar = self.llg.LLMatcher.grammar_from_json_schema(source)
        elif kind == "gbnf":
            grammar = self.llg.grammar_from("grammar", source)
        else:
            raise NotImplementedError("no Qwen tool-call preset")
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        self.fill(matcher, self.bitmask, 0)  # the lexer is built on first use: part of compiling
        return matcher

    def mask(self, matcher) -> None:  # noqa: ANN001
        self.fill(matcher, self.bitmask, 0)

    def allows(self, token: int) -> bool:
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def accept(self, matcher, token: int) -> bool:  # noqa: ANN001
        return matcher.consume_token(token)


def qwen_tool_tag() -> str:
    from xgrammar import get_model_structural_tag

    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": SCHEMA},
    }
    return get_model_structural_tag("qwen_3_5", tools=[tool], tool_choice="required").model_dump_json()


def tool_document() -> str:
    doc = json.loads(DOCUMENT)
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in doc.items()
    )
    return f"Let me look.\n</think>\n\n<tool_call>\n<function=get_weather>\n{params}</function>\n</tool_call>"


def measure(engine, kind: str, source: str, document: str, encode, limit: int) -> dict:  # noqa: ANN001
    t0 = time.perf_counter()
    matcher = engine.matcher(kind, source)
    compile_ms = 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.matcher(kind, source)
    cached_ms = 1000 * (time.perf_counter() - t0)
    times, rejected = [], 0
    for token in encode(document)[:limit]:
        t0 = time.perf_counter()
        engine.mask(matcher)
        times.append(1000 * (time.perf_counter() - t0))
        if not engine.allows(token) or not engine.accept(matcher, token):
            rejected += 1
            break
    times.sort()
    return {
        "compile_ms": round(compile_ms, 2),
        "cached_ms": round(cached_ms, 3),
        "mask_ms": round(statistics.mean(times), 4),
        "mask_p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 4),
        "tokens": len(times),
        "document_accepted": not rejected,
    }


def decode_share(path: Path, n_predict: int) -> dict:
    """ms per generated token of one greedy request with and without the JSON schema, on the engine (CPU)."""
    from mtpserve.engine import Engine, EngineConfig, GrammarSpec, Request, SamplingParams
    from mtpserve.engine.planner import plan_for_file
    from mtpserve.models.loader import load

    model, tokenizer = load(path), Tokenizer.from_gguf(path)
    config = EngineConfig(n_parallel=1, ctx_size=1024)
    prompt = tokenizer.encode("A person as JSON, with a name, an age and a role: ")
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    per_token: dict[str, list[float]] = {"plain": [], "constrained": []}
    n_tokens = 0
    with Engine(model, tokenizer, config, plan_for_file(path, config)) as engine:
        engine.compile_grammar(grammar)  # compiled once, as the server does before submitting
        for label, spec in [("plain", None), ("constrained", grammar)] * (1 + REPEATS):  # the first pair: warm-up
            request = Request(prompt, SamplingParams(temperature=0.0), n_predict=n_predict, grammar=spec)
            result = engine.submit(request).result()
            per_token[label].append(result.timings.predicted_ms / max(result.timings.predicted_n - 1, 1))
            n_tokens = result.timings.predicted_n if spec else n_tokens
    plain, constrained = (statistics.median(per_token[k][1:]) for k in ("plain", "constrained"))
    return {
        "model": path.name,
        "n_vocab": tokenizer.n_vocab,
        "decode_ms": round(plain, 3),
        "constrained_ms": round(constrained, 3),
        "constrained_tokens": n_tokens,
        "share": round((constrained - plain) / plain, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--tokens", type=int, default=200, help="masks timed per grammar (at most)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens a request generates in the share run")
    args = parser.parse_args(argv)
    qwen = Tokenizer.from_gguf(FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf")
    smol = Tokenizer.from_gguf(model_path(SMOLLM2))
    gemma = Tokenizer.from_gguf(model_path(GEMMA3))
    rows = []
    for label, tokenizer, size in (("qwen35 padded", qwen, DEPLOYMENT_VOCAB), ("SmolLM2", smol, smol.n_vocab)):
        tokens = vocabulary(tokenizer, size, gemma)
        eog = sorted(tokenizer.eog_ids)

        def encode(text: str, tokenizer: Tokenizer = tokenizer) -> list[int]:
            return tokenizer.encode(text, add_special=False)

        engines = [XGrammar(tokens, eog), LLGuidance(tokens, eog, encode)]
        grammars = [("json", json.dumps(SCHEMA), DOCUMENT), ("gbnf", ARITHMETIC, EXPRESSION)]
        if label.startswith("qwen"):
            grammars.append(("qwen tool call", qwen_tool_tag(), tool_document()))
        torch.set_num_threads(1)
        for engine in engines:
            for kind, source, document in grammars:
                try:
                    result = measure(engine, kind, source, document, encode, args.tokens)
                except NotImplementedError as e:
                    result = {"skipped": str(e)}
                row = {"vocab": label, "n_vocab": len(tokens), "engine": engine.name, "grammar": kind, **result}
                rows.append(row)
                print(json.dumps(row), flush=True)
    torch.set_num_threads(2)
    shares = []
    for path in (model_path(SMOLLM2), model_path(GEMMA3), FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"):
        shares.append(decode_share(path, args.decode_tokens))
        print(json.dumps(shares[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "decode_share": shares}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
