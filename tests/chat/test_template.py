"""Chat templates rendered as llama-server renders them: the exact Qwen3.5 prompts of
../shared/spec/chat-template.md §5, the reference prompts of every model, ChatML fallback, overrides,
and template errors as one clear exception."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from mtpserve.chat import CHATML_TEMPLATE, ChatPrompt, ChatTemplate, ChatTemplateError, resolve_chat_template
from mtpserve.chat.sandbox import to_json

from ..support.vocabs import REF_MODELS, model_tokenizer, reference

# Expected strings copied from ../shared/spec/chat-template.md §5 (llama.cpp's renders; the reference).
ONE_TURN_ON = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n"
ONE_TURN_OFF = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
SYSTEM_ON = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n"
)
TWO_TURN_ON = (
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there! How can I help?<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
)
QWEN36_TWO_TURN_NO_REASONING = (
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHi there! How can I "
    "help?<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
)
QWEN36_TWO_TURN_REASONING = (
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\nThe user greets me.\n</think>\n\nHi "
    "there! How can I help?<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
)
GEN_ON = "<|im_start|>assistant\n<think>\n"
GEN_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
TOOL_SYSTEM = '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT><|im_end|>\n'  # noqa: E501
TOOL_REST = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"  # noqa: E501

HELLO = [{"role": "user", "content": "Hello"}]
SYSTEM = [{"role": "system", "content": "You are a helpful assistant."}, *HELLO]
TWO_TURN = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]
TWO_TURN_REASONING = [TWO_TURN[0], {**TWO_TURN[1], "reasoning_content": "The user greets me."}, TWO_TURN[2]]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Need the tool.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


@pytest.fixture(scope="module")
def qwen35() -> ChatTemplate:
    """llama.cpp's Qwen3.5-4B template, as the tinyqwen35 GGUF carries it."""
    return ChatTemplate.for_tokenizer(model_tokenizer("tinyqwen35-mtp-F16"))


@pytest.mark.parametrize(
    ("messages", "thinking", "expected", "generation_prompt"),
    [
        (HELLO, True, ONE_TURN_ON, GEN_ON),
        (HELLO, False, ONE_TURN_OFF, GEN_OFF),
        (SYSTEM, True, SYSTEM_ON, GEN_ON),
        (SYSTEM, False, SYSTEM_ON.removesuffix(GEN_ON) + GEN_OFF, GEN_OFF),
        (TWO_TURN, True, TWO_TURN_ON, GEN_ON),
        (TWO_TURN_REASONING, True, TWO_TURN_ON, GEN_ON),  # Qwen3.5 never shows history reasoning
        (TWO_TURN, False, TWO_TURN_ON.removesuffix(GEN_ON) + GEN_OFF, GEN_OFF),
    ],
    ids=["1turn-on", "1turn-off", "system-on", "system-off", "2turn-on", "2turn-reasoning-on", "2turn-off"],
)
def test_qwen35_prompts_match_llama_cpp(qwen35, messages, thinking, expected, generation_prompt):
    out = qwen35.apply(messages, enable_thinking=thinking)
    assert out.prompt == expected
    assert out.generation_prompt == generation_prompt


def test_qwen35_thinking_is_on_by_default_and_off_through_kwargs(qwen35):
    assert qwen35.supports_thinking and qwen35.apply(HELLO).prompt == ONE_TURN_ON
    assert qwen35.apply(HELLO, chat_template_kwargs={"enable_thinking": False}).prompt == ONE_TURN_OFF


def test_qwen35_tool_call_round_trip(qwen35):
    out = qwen35.apply(TOOL_ROUND_TRIP, tools=[WEATHER_TOOL])
    assert out.prompt == TOOL_SYSTEM + TOOL_REST
    assert qwen35.apply(TOOL_ROUND_TRIP, tools=[{**WEATHER_TOOL, "extra": 1}]).prompt == out.prompt


def test_qwen36_preserved_thinking(qwen35):
    """The Qwen3.6 change (history keeps its think block when preserve_thinking is true), applied to the
    3.5 template, gives the spec's Qwen3.6 strings; `preserve_reasoning` sets `preserve_thinking`."""
    old = "{%- if loop.index0 > ns.last_query_index %}"
    assert old in qwen35.source
    new = "{%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index %}"
    qwen36 = ChatTemplate(qwen35.source.replace(old, new))
    keep = {"preserve_reasoning": True}
    assert qwen36.apply(TWO_TURN, chat_template_kwargs=keep).prompt == QWEN36_TWO_TURN_NO_REASONING
    assert qwen36.apply(TWO_TURN_REASONING, chat_template_kwargs=keep).prompt == QWEN36_TWO_TURN_REASONING
    assert qwen36.apply(TWO_TURN_REASONING, chat_template_kwargs={"preserve_reasoning": False}).prompt == TWO_TURN_ON
    assert qwen36.apply(TWO_TURN_REASONING).prompt == TWO_TURN_ON  # the deployment: preserve_thinking undefined


def test_qwen35_template_errors_are_clear(qwen35):
    with pytest.raises(ChatTemplateError, match="^No user query found in messages.$"):
        qwen35.apply([{"role": "assistant", "content": "hi"}])


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _system(text: str, role: str = "system") -> dict:
    return {"role": role, "content": text}


def test_system_messages_go_where_a_template_that_reads_one_at_the_start_takes_them(qwen35):
    """Qwen 3.5/3.6 raise "System message must be at the beginning" for a second or a late system message, which
    agents send (Codex: two leading developer items; Claude Code: a system message after the first user turn).
    The leading ones are joined; a late one joins the user message before it, else the one after it."""
    plain = {"enable_thinking": False}

    def prompt(messages: list[dict]) -> str:
        return qwen35.apply(messages, add_generation_prompt=False, chat_template_kwargs=plain).prompt

    assert prompt([_system("Base.", "developer"), _system("Permissions."), _user("Hi")]) == prompt(
        [_system("Base.\n\nPermissions."), _user("Hi")]
    )
    assert prompt([_user("Hi"), _system("Agents: a, b.")]) == prompt([_user("Hi\n\nAgents: a, b.")])
    answer = {"role": "assistant", "content": "Hello."}
    late = [_user("Hi"), answer, _system("Be brief."), _user("Why?")]
    assert prompt(late) == prompt([_user("Hi"), answer, _user("Be brief.\n\nWhy?")])
    # each turn's prompt extends the last one's: the late system message stays where it was sent
    first = [_user("Hi"), _system("Agents: a, b.")]
    assert prompt([*first, answer, _user("Go on.")]).startswith(prompt(first).removesuffix("<|im_end|>\n"))


def test_a_template_that_reads_system_messages_anywhere_gets_them_as_sent():
    chatml = ChatTemplate(CHATML_TEMPLATE)
    messages = [_system("A"), _system("B"), _user("Hi"), _system("late"), _user("Go")]
    rendered = chatml.apply(messages, add_generation_prompt=False).prompt
    assert rendered.count("<|im_start|>system\n") == 3 and "<|im_start|>system\nlate<|im_end|>" in rendered


@pytest.mark.parametrize("ref", REF_MODELS)
def test_reference_chat_prompts(ref):
    """Every model's /apply-template output; Gemma 3 has no template, so llama-server's ChatML."""
    tok = model_tokenizer(ref)
    data = reference(ref)
    tmpl = ChatTemplate.for_tokenizer(tok)
    assert tmpl.source == data["server_props_chat_template"]
    for case in data["greedy"]["chat"]:
        prompt = tmpl.apply(case["messages"]).prompt
        assert prompt == case["rendered_prompt"], case["name"]
        assert tok.encode(prompt, add_special=True, parse_special=True) == case["prompt_token_ids"], case["name"]


def test_gguf_without_template_falls_back_to_chatml():
    tok = model_tokenizer("gemma-3-270m-q4_k_m")
    assert tok.vocab.chat_template is None
    tmpl = ChatTemplate.for_tokenizer(tok)
    assert tmpl.source == CHATML_TEMPLATE and not tmpl.supports_thinking and tmpl.think_tags is None
    assert tmpl.apply(HELLO).prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_override(tmp_path):
    tok = model_tokenizer("tinyqwen35-mtp-F16")
    assert ChatTemplate.for_tokenizer(tok, "chatml").source == CHATML_TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert ChatTemplate.for_tokenizer(tok, str(path)).apply(HELLO).prompt == "[user]Hello"
    assert resolve_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ChatTemplateError, match="not a built-in name"):
        ChatTemplate.for_tokenizer(tok, "no-such-template")


def test_bos_text_is_stripped_when_the_tokenizer_adds_bos():
    src = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
    adds = ChatTemplate(src, bos_token="<s>", eos_token="</s>", add_bos=True, add_eos=True)
    keeps = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    assert adds.apply(HELLO).prompt == "<user>Hello"
    assert keeps.apply(HELLO).prompt == "<s><user>Hello</s>"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{% if %}", "chat template parsing error"),
        ("{{ raise_exception('Only user and assistant roles are supported!') }}", "^Only user and assistant roles"),
        ("{{ messages[0].nope.deeper }}", "chat template rendering error: UndefinedError"),
        ("{{ messages.append(1) }}", "chat template rendering error: SecurityError"),
        ("{{ ().__class__.__bases__ }}", "chat template rendering error"),
        ("{{ 1 / 0 }}", "chat template rendering error: ZeroDivisionError"),
    ],
)
def test_template_errors_are_one_exception(source, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source).apply(HELLO)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", "'messages' must be an array"),
        ([{"content": "x"}], "Missing 'role'"),
        ([{"role": "user"}], "Expected 'content' or 'tool_calls'"),
        ([{"role": "user", "content": 3}], "Invalid 'content' type"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "Unsupported content part type"),
        # drawn by the schema fuzzer: a bool was iterated (a 500)
        ([{"role": "tool", "tool_calls": True}], "'tool_calls' must be an array of tool calls"),
        ([{"role": "assistant", "tool_calls": {"type": "function"}}], "'tool_calls' must be an array"),
        (
            [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}],
            "Failed to parse tool call arguments as JSON",
        ),
    ],
)
def test_bad_messages_are_clear_errors(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(CHATML_TEMPLATE).apply(messages)


def test_enable_thinking_must_be_a_bool(qwen35):
    with pytest.raises(ChatTemplateError, match='invalid type for "enable_thinking"'):
        qwen35.apply(HELLO, chat_template_kwargs={"enable_thinking": "false"})


def test_generation_prompt_when_the_prompt_is_not_a_prefix():
    """The suffix after the longest common prefix, as llama.cpp computes it."""
    src = "{% if add_generation_prompt %}AB{% else %}AC{% endif %}"
    assert ChatTemplate(src).apply(HELLO) == ChatPrompt("AB", "B")


def test_bad_tools_are_clear_errors():
    with pytest.raises(ChatTemplateError, match="Failed to parse tools"):
        ChatTemplate(CHATML_TEMPLATE).apply(HELLO, tools=[{"type": "retrieval"}])


def test_message_normalisation():
    """What the template sees: developer -> system, content "" when absent, arguments as objects."""
    seen = ChatTemplate("{{ messages | tojson }}|{{ tools | tojson }}").apply(
        [
            {"role": "developer", "content": "rules"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1.0, "b": "é"}'}}],
            },
        ],
        tools=[{"type": "function", "function": {"name": "f"}}],
    )
    messages, tools = seen.prompt.split("|")
    assert messages == (
        '[{"role": "system", "content": "rules"}, {"role": "assistant", "content": "", "tool_calls": '
        '[{"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": "é"}}}]}]'
    )
    assert tools == '[{"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}]'


def test_typed_content_parts():
    """Parts stay a list for a template that reads them (Qwen3.5 joins their texts); ChatML reads only
    strings, so parts are joined with newlines first, as llama.cpp does."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    chatml = ChatTemplate(CHATML_TEMPLATE).apply(parts).prompt
    assert chatml == "<|im_start|>user\nHel\nlo<|im_end|>\n<|im_start|>assistant\n"
    qwen = ChatTemplate.for_tokenizer(model_tokenizer("tinyqwen35-mtp-F16"))
    assert qwen.apply(parts).prompt == ONE_TURN_ON


def test_template_without_system_role_gets_it_folded_into_the_first_message():
    src = "{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
    out = ChatTemplate(src).apply([{"role": "system", "content": "Be brief."}, *HELLO]).prompt
    assert out == "<user>Be brief.\nHello"


def test_template_variables():
    src = (
        "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}|{{ add_generation_prompt is defined }}|"
        "{{ tools is defined }}|{{ date_string }}|{{ strftime_now('%Y-%m-%d') }}|{{ custom }}|"
        "{{ preserve_thinking }}|{{ clear_thinking }}|{{ reasoning_strength }}"
    )
    tmpl = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    now = dt.datetime(2026, 3, 4, 5, 6, 7)
    kwargs = {"custom": [1, "x"], "preserve_reasoning": True, "reasoning_effort": "high"}
    out = tmpl.apply(HELLO, chat_template_kwargs=kwargs, now=now, add_generation_prompt=False)
    assert out.prompt == "<s>|</s>|False|False|False|04 Mar 2026|2026-03-04|[1, 'x']|True|False|high"
    assert tmpl.apply(HELLO, now=now).prompt.split("|")[3] == "True"


def test_loop_controls_and_namespace():
    src = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ m.content }}{% if loop.index0 == 2 %}{% break %}{% endif %}{% endfor %}"
        "={{ ns.n }}"
    )
    msgs = [{"role": "user", "content": c} for c in "abcd"]
    assert ChatTemplate(src).apply(msgs).prompt == "ac=2"


def test_tojson_writes_what_llama_cpp_writes():
    value = {"b": 1.0, "a": [0.1, 1e-7, 123456789.0, True, None], "é": '"\n\x01'}
    assert to_json(value) == '{"b": 1, "a": [0.1, 1e-07, 1.23457e+08, true, null], "é": "\\"\\n\\u0001"}'
    assert to_json([1, {"x": []}], indent=2) == '[\n  1,\n  {\n    "x": []\n  }\n]'
    assert to_json({"é": 1}, ensure_ascii=True) == '{"\\u00e9": 1}'
    assert json.loads(to_json(value)) == {"b": 1, "a": [0.1, 1e-07, 1.23457e08, True, None], "é": '"\n\x01'}


BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
LLAMA3_GEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.mark.parametrize(
    ("prefill", "continued"),
    [("Whill", "Whill"), ([{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}], "Wh\n\nill")],
)
def test_continued_final_message_ends_the_prompt_open(prefill, continued):
    """llama-server's test_chat_template_assistant_prefill: the other messages and the generation prompt, then the
    message's content as is (its text parts joined with "\\n\\n"), with no end of turn."""
    llama3 = ChatTemplate(resolve_chat_template("llama3"))
    out = llama3.apply([*BOOK, {"role": "assistant", "content": prefill}], continue_final_message="auto")
    assert out == ChatPrompt(
        "<|start_header_id|>system<|end_header_id|>\n\nBook<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "What is the best book<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n" + continued,
        LLAMA3_GEN,
        continued,
    )
    assert llama3.apply(BOOK, add_generation_prompt=True).prompt + continued == out.prompt


@pytest.mark.parametrize(
    ("answer", "mode", "prefill"),
    [
        ({"content": "Hel"}, "auto", "<think>\n\n</think>\n\nHel"),
        ({"content": "Hel", "reasoning_content": "Greet."}, "auto", "<think>\nGreet.\n</think>\n\nHel"),
        ({"content": "Hel", "reasoning_content": "Greet."}, "content", "<think>\nGreet.\n</think>\n\nHel"),
        ({"content": "", "reasoning_content": "Gre"}, "auto", "<think>\nGre"),
        ({"content": "Hel", "reasoning_content": "Gre"}, "reasoning_content", "<think>\nGre"),
    ],
    ids=["content", "both", "content-asked", "reasoning", "reasoning-asked"],
)
@pytest.mark.parametrize("thinking", [True, False])
def test_qwen35_continues_content_or_reasoning(qwen35, answer, mode, prefill, thinking):
    """llama.cpp's Qwen3.5 handler (common/parsers/qwen3-coder.cpp): `<|im_start|>assistant\\n<think>\\n` +
    reasoning, then `\\n</think>\\n\\n` + content unless only the reasoning is continued, thinking on or off."""
    out = qwen35.apply([*HELLO, {"role": "assistant", **answer}], continue_final_message=mode, enable_thinking=thinking)
    assert out == ChatPrompt(ONE_TURN_ON.removesuffix("<think>\n") + prefill, "<|im_start|>assistant\n", prefill)


def test_continued_reasoning_without_think_tags_adds_nothing():
    """A template without reasoning tags continues only content: reasoning alone leaves the generation prompt."""
    out = ChatTemplate(CHATML_TEMPLATE).apply(
        [*HELLO, {"role": "assistant", "content": None, "reasoning_content": "Hmm"}], continue_final_message="auto"
    )
    assert out == ChatPrompt("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>assistant\n")


def test_unknown_continuation_is_an_error():
    with pytest.raises(ChatTemplateError, match="continue_final_message must be one of"):
        ChatTemplate(CHATML_TEMPLATE).apply(HELLO, continue_final_message="everything")
