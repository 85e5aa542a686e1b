"""llama.cpp's named chat templates (`--chat-template NAME`) as Jinja sources of our own.

llama.cpp formats these names in C++ (llama_chat_apply_template, src/llama-chat.cpp), not with Jinja; each
source here writes exactly what that formatter writes for system, user and assistant messages and
`add_generation_prompt` (llama.cpp's `trim` strips C `isspace`: `str.strip(_WS)` here, not Jinja's unicode `trim`).
Content is only ever concatenated to strings, so a template reads string content alone and typed parts reach
it joined with "\\n", as llama.cpp's legacy path joins them. Names llama.cpp formats without a generation
prompt (llama2, mistral) have none here either.
"""

from __future__ import annotations

import json

CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)  # llama.cpp's own Jinja source for `chatml` (common/chat.cpp CHATML_TEMPLATE_SRC), its Jinja fallback too

_WS = r'" \t\n\v\f\r"'  # C isspace, as a Jinja literal
_TRIMMED = "{%- set c = m.content.strip(" + _WS + ") -%}"  # llama.cpp's trim(); fails on a list, as it should
_AS_IS = "{%- set c = '' + m.content -%}"


def _lit(text: str) -> str:
    """A Jinja string literal (JSON's escapes are Jinja's)."""
    return json.dumps(text, ensure_ascii=False)


def _loop(body: str, generation: str = "", *, trim: bool = False, head: str = "") -> str:
    """`head`, then the Jinja statements `body` for every message `m` (its content as `c`), then `generation`."""
    prompt = "{%- if add_generation_prompt -%}{{- " + _lit(generation) + " -}}{%- endif -%}" if generation else ""
    return head + "{%- for m in messages -%}" + (_TRIMMED if trim else _AS_IS) + body + "{%- endfor -%}" + prompt


def _each(turn: str, generation: str = "", *, trim: bool = False, head: str = "") -> str:
    """The Jinja expression `turn` for every message."""
    return _loop("{{- " + turn + " -}}", generation, trim=trim, head=head)


def _roles(
    wrap: dict[str, tuple[str, str]],
    generation: str = "",
    *,
    other: tuple[str, str] | None = None,
    trim: bool = False,
) -> str:
    """Each message's content between its role's prefix and suffix; `other` for the roles not in `wrap`
    (None: such messages are left out)."""
    body = ""
    for i, (role, (prefix, suffix)) in enumerate(wrap.items()):
        body += ("{%- if " if i == 0 else "{%- elif ") + "m.role == " + _lit(role) + " -%}"
        body += "{{- " + _lit(prefix) + " + c + " + _lit(suffix) + " -}}"
    if other is not None:
        body += "{%- else -%}{{- " + _lit(other[0]) + " + c + " + _lit(other[1]) + " -}}"
    return _loop(body + "{%- endif -%}", generation, trim=trim)


def _llama2(system: bool, bos_in_history: bool = False, strip: bool = False) -> str:
    """llama2 and its variants: system in <<SYS>> (or plain, first in the turn), `[INST]` reopened after each
    answer (with a BOS inside the history for -bos), every message trimmed for -strip."""
    reopen = "<s>[INST] " if bos_in_history else "[INST] "
    system_turn = "'<<SYS>>\\n' + c + '\\n<</SYS>>\\n\\n'" if system else "c + '\\n'"
    body = (
        "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- " + _lit(reopen) + " -}}{%- endif -%}"
        "{%- if m.role == 'system' -%}{{- " + system_turn + " -}}"
        "{%- elif m.role == 'user' -%}{{- c + ' [/INST]' -}}"
        "{%- else -%}{{- c + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}"
    )
    return _loop(body, trim=strip, head="{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}")


def _mistral(lead: str, trail: str, trim_answers: bool = False) -> str:
    """Mistral v1/v3/v3-tekken: `[INST]` opened before a turn, system text at its start, answers after `[/INST]`."""
    answer = f"c.strip({_WS})" if trim_answers else "c"
    body = (
        "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- " + _lit(lead + "[INST]" + trail) + " -}}{%- endif -%}"
        "{%- if m.role == 'system' -%}{{- c + '\\n\\n' -}}"
        "{%- elif m.role == 'user' -%}{{- c + " + _lit(lead + "[/INST]") + " -}}"
        "{%- else -%}{{- " + _lit(trail) + " + " + answer + " + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}"
    )
    return _loop(body, head="{%- set ns = namespace(inside=false) -%}")


def _mistral_v7(space: str) -> str:
    """Mistral v7 (and v7-tekken, without the spaces): every role but system and user is an answer."""
    wrap = {"system": (f"[SYSTEM_PROMPT]{space}", "[/SYSTEM_PROMPT]"), "user": (f"[INST]{space}", "[/INST]")}
    return _roles(wrap, other=(space, "</s>"))


# Gemma has no system role: system texts (trimmed, joined) open the next non-model turn.
_GEMMA = _loop(
    "{%- if m.role == 'system' -%}{%- set ns.system = ns.system + c -%}{%- else -%}"
    "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
    "{{- c + '<end_of_turn>\\n' -}}{%- endif -%}",
    "<start_of_turn>model\n",
    trim=True,
    head="{%- set ns = namespace(system='') -%}",
)

_EOS_DEEPSEEK = "<｜end▁of▁sentence｜>"

TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "llama2": _llama2(system=False),
    "llama2-sys": _llama2(system=True),
    "llama2-sys-bos": _llama2(system=True, bos_in_history=True),
    "llama2-sys-strip": _llama2(system=True, strip=True),
    "mistral-v1": _mistral(lead=" ", trail=" "),
    "mistral-v3": _mistral(lead="", trail=" ", trim_answers=True),
    "mistral-v3-tekken": _mistral(lead="", trail=""),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _each(r"'<|' + m.role + '|>\n' + c + '<|end|>\n'", "<|assistant|>\n"),
    "phi4": _each("'<|im_start|>' + m.role + '<|im_sep|>' + c + '<|im_end|>'", "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _each(r"'<|' + m.role + '|>\n' + c + '\n'", "<|assistant|>\n"),
    "zephyr": _each(r"'<|' + m.role + '|>\n' + c + '<|endoftext|>\n'", "<|assistant|>\n"),
    "gemma": _GEMMA,
    "openchat": _each(
        "(c if m.role == 'system' else 'GPT4 Correct ' + m.role[:1].upper() + m.role[1:] + ': ' + c)"
        " + '<|end_of_turn|>'",
        "GPT4 Correct Assistant:",
    ),
    "vicuna": _roles(
        {"system": ("", "\n\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "</s>\n")}, "ASSISTANT:"
    ),
    "vicuna-orca": _roles(
        {"system": ("SYSTEM: ", "\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "</s>\n")}, "ASSISTANT:"
    ),
    "deepseek": _roles(
        {"system": ("", ""), "user": ("### Instruction:\n", "\n"), "assistant": ("### Response:\n", "\n<|EOT|>\n")},
        "### Response:\n",
    ),
    "deepseek2": _roles(
        {"system": ("", "\n\n"), "user": ("User: ", "\n\n"), "assistant": ("Assistant: ", _EOS_DEEPSEEK)},
        "Assistant:",
    ),
    "deepseek3": _roles(
        {"system": ("", "\n\n"), "user": ("<｜User｜>", ""), "assistant": ("<｜Assistant｜>", _EOS_DEEPSEEK)},
        "<｜Assistant｜>",
    ),
    "command-r": _roles(
        {
            role: (f"<|START_OF_TURN_TOKEN|><|{token}|>", "<|END_OF_TURN_TOKEN|>")
            for role, token in (("system", "SYSTEM_TOKEN"), ("user", "USER_TOKEN"), ("assistant", "CHATBOT_TOKEN"))
        },
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        trim=True,
    ),
    "llama3": _each(
        r"'<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + c + '<|eot_id|>'",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        trim=True,
    ),
    "llama4": _each(
        r"'<|header_start|>' + m.role + '<|header_end|>\n\n' + c + '<|eot|>'",
        "<|header_start|>assistant<|header_end|>\n\n",
        trim=True,
    ),
    "chatglm3": _each(r"'<|' + m.role + '|>\n ' + c", "<|assistant|>", head="{{- '[gMASK]sop' -}}"),
    "chatglm4": _each(r"'<|' + m.role + '|>\n' + c", "<|assistant|>\n", head="{{- '[gMASK]<sop>' -}}"),
    "granite": _each(
        r"'<|start_of_role|>' + m.role + '<|end_of_role|>' + c + '<|end_of_text|>\n'",
        "<|start_of_role|>assistant<|end_of_role|>",
    ),
}
