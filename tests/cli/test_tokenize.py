"""`mtpserve tokenize`: ids as a JSON list, pieces, chats, on a fixture and on the default model."""

from __future__ import annotations

import json

from mtpserve.cli import main

from ..conftest import default_model, tinyqwen_path
from ..support.vocabs import reference


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["tokenize", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_tokenize_fixture_prompt(capsys):
    case = reference("tinyqwen35-mtp-F16")["greedy"]["completions"][0]
    rc, out, _ = run(capsys, "-m", str(tinyqwen_path("F16")), case["prompt"])
    assert rc == 0 and json.loads(out) == case["prompt_token_ids"]


def test_tokenize_default_model_and_file(capsys, tmp_path):
    default_model("smollm2")
    case = reference("SmolLM2-135M-Instruct.Q4_1")["greedy"]["chat"][0]
    text_file = tmp_path / "prompt.txt"
    text_file.write_text(case["rendered_prompt"], encoding="utf-8")
    rc, out, _ = run(capsys, "--file", str(text_file))
    assert rc == 0 and json.loads(out) == case["prompt_token_ids"]


def test_no_parse_special_and_pieces(capsys):
    model = str(tinyqwen_path("F16"))
    rc, out, _ = run(capsys, "-m", model, "--show-pieces", "<think>x")
    assert rc == 0 and out.splitlines() == ['   4094 -> "<think>"', '     87 -> "x"']
    rc, out, _ = run(capsys, "-m", model, "--no-parse-special", "<think>x")
    assert 4094 not in json.loads(out)


def test_chat_input_with_template_override(capsys):
    model = str(tinyqwen_path("F16"))
    chat = json.dumps([{"role": "user", "content": "Hello"}])
    rc, out, _ = run(capsys, "-m", model, "--chat", "--apply-template", chat)
    assert (rc, out) == (0, "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n")
    rc, out, _ = run(capsys, "-m", model, "--chat", "--apply-template", "--chat-template", "chatml", chat)
    assert out == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    kwargs = '{"enable_thinking": false}'
    rc, out, _ = run(capsys, "-m", model, "--chat", "--chat-template-kwargs", kwargs, chat)
    assert json.loads(out)[-6:] == [4094, 198, 198, 4095, 198, 198]  # <think>\n\n</think>\n\n


def test_errors_are_one_line(capsys):
    rc, _, err = run(capsys, "-m", str(tinyqwen_path("F16")), "--chat", '[{"role": "user"}]')
    assert rc == 1 and err.startswith("mtpserve tokenize: error: chat template: Expected 'content'")
    rc, _, err = run(capsys, "-m", str(tinyqwen_path("F16")))
    assert rc == 1 and "give the text" in err


def test_a_file_is_read_as_its_bytes(capsys, tmp_path):
    """CRLF stays CRLF (llama-tokenize reads bytes; text mode would make it LF)."""
    model = str(tinyqwen_path("F16"))
    text_file = tmp_path / "crlf.txt"
    text_file.write_bytes(b"line1\r\nline2\r\n")
    rc, out, _ = run(capsys, "-m", model, "--file", str(text_file))
    _, direct, _ = run(capsys, "-m", model, "line1\r\nline2\r\n")
    _, lf, _ = run(capsys, "-m", model, "line1\nline2\n")
    assert rc == 0 and json.loads(out) == json.loads(direct) != json.loads(lf)
