"""POST /infill (server/infill.py) held to llama-server's: on tinyqwen35 given FIM tokens (tests/support/fim_models.py),
the prompt llama-server rendered and evaluated and its greedy tokens up to the first near tie
(tests/fixtures/tinyqwen35_infill_llama.json, bench/record_infill_ref.py), three server configurations that cut the
prefix, suffix and extra files; llama-server's refusals (a model without FIM tokens, malformed fields); what editor
clients send besides (n_indent, t_max_predict_ms, response_fields, their own sampler chain with the infill stage),
against recorded llama-server answers; and the prompt's layout token by token on a vocabulary with a BOS token."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest

from mtpserve.engine.sampler_order import stage_names
from mtpserve.server.errors import APIError
from mtpserve.server.infill import InfillLimits, infill_prompt
from mtpserve.server.params import Body
from mtpserve.tokenizer import Tokenizer

from ..conftest import fuzz_examples
from ..support.drawn import for_drawn_cases
from ..support.fim_models import FIM_VARIANTS, fim_model
from ..support.server_process import ServerProcess
from .conftest import TINY_KEY

RECORD = json.loads((Path(__file__).parents[1] / "fixtures" / "tinyqwen35_infill_llama.json").read_text())
CONFIGS = sorted({(a["variant"], tuple(a["flags"])) for a in RECORD["answers"]})
GREEDY = {
    "n_predict": RECORD["n_predict"],
    "temperature": 0.0,
    "n_probs": 2,
    "cache_prompt": False,
    "return_tokens": True,
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("infill")
    started = {}
    try:
        for variant, flags in CONFIGS:
            args = ["-m", str(fim_model(variant, directory)), *RECORD["server_flags"], *flags]
            started[(variant, flags)] = ServerProcess(args, directory / f"{variant}{'-spm' if flags else ''}.log")
        yield started
    finally:
        for process in started.values():
            process.stop()


def _id(answer: dict) -> str:
    return "-".join([answer["variant"], *[f.strip("-") for f in answer["flags"]], answer["case"]])


@pytest.mark.parametrize("answer", RECORD["answers"], ids=_id)
def test_infill_evaluates_llama_servers_prompt_and_gives_its_tokens(servers, answer):
    url = servers[(answer["variant"], tuple(answer["flags"]))].url
    ours = httpx.post(f"{url}/infill", json=RECORD["cases"][answer["case"]] | GREEDY, timeout=120).json()
    assert ours["prompt"] == answer["prompt"]
    assert ours["tokens_evaluated"] == answer["tokens_evaluated"]
    expected = answer["generated_token_ids"]
    agree = (answer["near_tie_positions"] or [len(expected)])[0]
    assert ours["tokens"][:agree] == expected[:agree]
    if not answer["near_tie_positions"]:
        assert ours["tokens"] == expected


EDITOR = {name: case for name, case in RECORD["editor"].items() if "near_tie_positions" in case}
OWN_CHAINS = {name: case for name, case in RECORD["editor"].items() if "tokens" in case}


@pytest.mark.parametrize("name", sorted(EDITOR))
def test_n_indent_ends_an_answer_where_llama_servers_ends(servers, name):
    """An editor's minimum indentation: the first line after a newline indented less (an empty one too) ends the
    answer, cut after its indentation (stop_type "limit")."""
    case = EDITOR[name]
    body = case["body"] | {"temperature": 0.0, "cache_prompt": False, "return_tokens": True}
    ours = httpx.post(f"{servers[('fim_repo', ())].url}{case['path']}", json=body, timeout=120).json()
    expected, ties = case["generated_token_ids"], case["near_tie_positions"]
    agree = (ties or [len(expected)])[0]
    assert ours["tokens"][:agree] == expected[:agree]
    if not ties:  # the whole answer is llama-server's
        assert (ours["tokens"], ours["content"], ours["stop_type"]) == (expected, case["content"], case["stop_type"])


@pytest.mark.parametrize("name", sorted(OWN_CHAINS))
def test_an_own_sampler_chain_draws_llama_servers_tokens(servers, name):
    """`samplers` names the chain's stages and their order (llama.vim's and llama.vscode's ["top_k", "top_p",
    "infill"], chars, a temperature stage first, penalties after top-k): with the same seed the same draws."""
    case = OWN_CHAINS[name]
    body = {"n_predict": 24} | case["body"] | {"cache_prompt": False, "return_tokens": True}
    ours = httpx.post(f"{servers[('fim_repo', ())].url}{case['path']}", json=body, timeout=120).json()
    assert (ours["tokens"], ours["content"]) == (case["tokens"], case["content"])
    assert ours["generation_settings"]["samplers"] == list(stage_names(case["body"]["samplers"]) or ())


def test_response_fields_keep_the_fields_asked_for_flat_as_llama_server(servers):
    recorded = RECORD["editor"]["response_fields"]
    ours = httpx.post(f"{servers[('fim_repo', ())].url}/infill", json=recorded["body"], timeout=120).json()
    assert sorted(ours) == recorded["keys"] and ours["content"] == recorded["content"]
    assert isinstance(ours["timings/prompt_n"], int) and "nothing/here" not in ours
    bad = httpx.post(f"{servers[('fim', ())].url}/infill", json=recorded["body"] | {"response_fields": "content"})
    assert bad.status_code == 400 and "response_fields" in bad.json()["error"]["message"]


def test_t_max_predict_ms_ends_the_answer_at_a_newline_once_the_time_is_spent(servers):
    """A time limit counts only at a token that sends a newline: with 1 ms the answer ends at the first such
    token after the first millisecond (64 tokens take longer than that anywhere), with a minute it runs on."""
    url = servers[("fim_repo", ())].url
    case = RECORD["editor"]["completion_no_indent_limit"]
    body = case["body"] | {"temperature": 0.0, "cache_prompt": False}
    whole = httpx.post(f"{url}/completion", json=body | {"t_max_predict_ms": 60_000}, timeout=120).json()
    assert whole["tokens_predicted"] == 64 and whole["content"].count("\n") >= 4
    cut = httpx.post(f"{url}/completion", json=body | {"t_max_predict_ms": 1}, timeout=120).json()
    assert cut["stop_type"] == "limit" and cut["tokens_predicted"] < 64
    assert cut["content"].endswith("\n") and whole["content"].startswith(cut["content"])


def test_a_streamed_infill_gives_the_same_text(servers):
    url = servers[("fim_repo", ())].url
    body = RECORD["cases"]["extra_files"] | GREEDY
    whole = httpx.post(f"{url}/infill", json=body, timeout=120).json()
    with httpx.stream("POST", f"{url}/infill", json=body | {"stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] and events[-1]["tokens_evaluated"] == whole["tokens_evaluated"]


def test_choices_are_one_answer_each_as_for_completion(servers):
    url = servers[("fim", ())].url
    body = RECORD["cases"]["llama_test"] | {"n_predict": 4, "temperature": 0.0, "n": 2}
    answers = httpx.post(f"{url}/infill", json=body, timeout=120).json()
    assert [a["index"] for a in answers] == [0, 1] and answers[0]["content"] == answers[1]["content"]
    refused = httpx.post(f"{url}/infill", json=body | {"stream": True}, timeout=60)
    assert refused.status_code == 400 and "several prompts or choices" in refused.json()["error"]["message"]
    refused = httpx.post(f"{url}/infill", json=RECORD["cases"]["llama_test"] | {"n_probs": True}, timeout=60)
    assert refused.status_code == 400 and "n_probs" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    "input_extra",
    # llama.cpp's test_invalid_input_extra_req, and a chunk that is not an object
    [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"}, {"filename": 123, "text": 456}, "x"],
)
def test_malformed_extra_files_are_refused(servers, input_extra):
    body = {
        "input_extra": [input_extra],
        "input_prefix": "int main() {\n",
        "prompt": "    int n = ",
        "input_suffix": "}",
    }
    response = httpx.post(f"{servers[('fim', ())].url}/infill", json=body, timeout=60)
    assert response.status_code == 400 and "extra_context chunk" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_suffix": "}"}, '"input_prefix" is required'),
        ({"input_prefix": "{"}, '"input_suffix" is required'),
        ({"input_prefix": "{", "input_suffix": "}", "prompt": 5}, '"prompt" must be a string'),
        ({"input_prefix": "{", "input_suffix": "}", "input_extra": {}}, '"input_extra" must be an array'),
        ({"input_prefix": [True], "input_suffix": "}"}, "Field 'input_prefix'"),
        ({"input_prefix": "{", "input_suffix": [1 << 20]}, "outside the vocabulary"),
    ],
)
def test_malformed_fields_are_refused_and_the_server_keeps_serving(servers, body, message):
    url = servers[("fim", ())].url
    response = httpx.post(f"{url}/infill", json=body, timeout=60)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    ok = httpx.post(f"{url}/infill", json={"input_prefix": "x = ", "input_suffix": "", "n_predict": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["tokens_predicted"] == 2


def test_a_model_without_fim_tokens_answers_501(tiny_server):
    body = {"input_prefix": "int main() {\n", "input_suffix": "}\n"}
    response = httpx.post(f"{tiny_server.url}/infill", json=body, headers={"Authorization": f"Bearer {TINY_KEY}"})
    assert response.status_code == 501
    error = response.json()["error"]
    assert error["type"] == "not_supported_error"
    assert error["message"] == (
        "Infill is not supported by this model: prefix token is missing. suffix token is missing. "
        "middle token is missing. "
    )


def test_drawn_bodies_make_no_server_error(servers):
    """schemathesis draws /infill bodies, schema-valid and schema-invalid, against the model with FIM tokens."""
    import schemathesis
    from schemathesis import GenerationMode

    url = servers[("fim_repo", ())].url
    api = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operation = next(r.ok() for r in api.get_all_operations() if r.ok().path == "/infill")
    tried = 0

    def check(case) -> None:
        nonlocal tried
        tried += 1
        if isinstance(case.body, dict):
            case.body["n_predict"] = 2  # short answers: the point is the input
        response = case.call(timeout=60)
        assert response.status_code < 500, f"{case.body!r:.300} -> {response.status_code} {response.text[:300]}"
        if response.status_code >= 400:
            assert response.json()["error"]["code"] == response.status_code

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for_drawn_cases(operation, mode, fuzz_examples(25), check)
    assert tried >= fuzz_examples(25)


# --- the prompt's layout, token by token ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo_tokenizer(tmp_path_factory) -> Tokenizer:
    """The repo variant's tokenizer, with a BOS token added at the front (as Llama-family vocabularies have)."""
    tokenizer = Tokenizer.from_gguf(fim_model("fim_repo", tmp_path_factory.mktemp("fim")))
    return Tokenizer(dataclasses.replace(tokenizer.vocab, add_bos=True))


def _text(tokenizer: Tokenizer, s: str) -> list[int]:
    return tokenizer.encode(s, add_special=False, parse_special=False)


def test_the_repo_pattern_puts_files_then_bos_prefix_prompt_suffix_middle(repo_tokenizer):
    t, ids = repo_tokenizer, FIM_VARIANTS["fim_repo"]
    body = Body(
        {
            "input_extra": [{"filename": "a.py", "text": "A = 1\n"}, {"text": "B = 2\n"}],
            "input_prefix": "import a\n",
            "prompt": "x = ",
            "input_suffix": "print(x)\n",
        }
    )
    prompt = infill_prompt(body, t, InfillLimits(n_batch=2048, n_predict=-1, n_ctx=8192))
    files = [ids["fim_rep"], *_text(t, "myproject\n")]
    files += [ids["fim_sep"], *_text(t, "a.py\n"), *_text(t, "A = 1\n")]
    files += [ids["fim_sep"], *_text(t, "tmp\n"), *_text(t, "B = 2\n")]
    files += [ids["fim_sep"], *_text(t, "filename\n")]
    prefix = [ids["fim_pre"], *_text(t, "import a\n"), *t.encode("x = ", add_special=False, parse_special=True)]
    suffix = [ids["fim_suf"], *_text(t, "print(x)\n")]
    assert prompt == [*files, t.bos_id, *prefix, *suffix, ids["fim_mid"]]
    spm = infill_prompt(body, t, InfillLimits(n_batch=2048, n_predict=-1, n_ctx=8192, spm=True))
    assert spm == [*files, t.bos_id, *suffix, *prefix, ids["fim_mid"]]


def test_the_batch_and_context_cut_the_prefix_suffix_and_files_as_llama_server(repo_tokenizer):
    t, ids = repo_tokenizer, FIM_VARIANTS["fim_repo"]
    prefix, suffix = list(range(100, 300)), list(range(300, 400))
    fields = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": [{"text": "y = 2\n" * 50}]}
    files = [ids["fim_rep"], *_text(t, "myproject\n"), ids["fim_sep"], *_text(t, "tmp\n"), *_text(t, "y = 2\n" * 50)]
    files += [ids["fim_sep"], *_text(t, "filename\n")]
    tail = t.encode("\x00", add_special=False, parse_special=True)
    assert len(tail) == 1 and len(files) > 104
    # -b 64: the prefix's last 48 tokens, the suffix's first 16 - (2 + 1); -c 200 -n 16: the files' last 104
    out = infill_prompt(Body(fields | {"prompt": "\x00"}), t, InfillLimits(n_batch=64, n_predict=16, n_ctx=200))
    kept = [ids["fim_pre"], *prefix[-48:], *tail, ids["fim_suf"], *suffix[:13], ids["fim_mid"]]
    assert out == [*files[-104:], t.bos_id, *kept]
    # -c 64 -b 64 -n -1: two tokens of files (n_ctx - n_batch - 2 n_predict)
    out = infill_prompt(Body(fields), t, InfillLimits(n_batch=64, n_predict=-1, n_ctx=64))
    assert out[:3] == [*files[-2:], t.bos_id]


def test_files_that_overflow_the_slot_give_llama_servers_prompt_length(tmp_path):
    """Without -n the files keep n_ctx - n_batch + 2 tokens, and with the rest the prompt overflows a 512-token
    slot: llama-server answered 400 exceed_context_size_error naming the prompt's length, which the server's own
    context check then names here too."""
    overflow = RECORD["overflow"]
    assert overflow["status"] == 400 and overflow["error"]["type"] == "exceed_context_size_error"
    t = Tokenizer.from_gguf(fim_model(overflow["variant"], tmp_path))
    out = infill_prompt(Body(RECORD["cases"][overflow["case"]]), t, InfillLimits(n_batch=64, n_ctx=512))
    assert len(out) == overflow["error"]["n_prompt_tokens"] > 512


def test_without_a_file_separator_files_follow_the_snippet_line(tmp_path):
    t, ids = Tokenizer.from_gguf(fim_model("fim", tmp_path)), FIM_VARIANTS["fim"]
    body = Body(
        {"input_extra": [{"filename": "ignored.py", "text": "A = 1\n"}], "input_prefix": "", "input_suffix": ""}
    )
    out = infill_prompt(body, t, InfillLimits(n_ctx=4096, n_batch=2048))
    assert out == [
        *_text(t, "\n\n--- snippet ---\n\n"),
        *_text(t, "A = 1\n"),
        ids["fim_pre"],
        ids["fim_suf"],
        ids["fim_mid"],
    ]


def test_a_model_without_fim_tokens_is_refused_before_the_body_is_read(tmp_path):
    from ..conftest import tinyqwen_path

    with pytest.raises(APIError) as e:
        infill_prompt(Body({}), Tokenizer.from_gguf(tinyqwen_path("Q4_K_M")), InfillLimits())
    assert e.value.code == 501
