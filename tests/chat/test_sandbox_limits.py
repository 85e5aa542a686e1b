"""Chat templates are untrusted code (they come from GGUF files): a render is bounded in time and size.

Each hostile template below must end in a `ChatTemplateLimitError` (a ChatTemplateError, so an HTTP 400)
that names the limit, quickly, and without allocating what it asked for (tracemalloc peak well under the
gigabytes requested); ordinary templates render as before (tests/chat/test_template.py covers them all).
"""

from __future__ import annotations

import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest

from mtpserve.chat import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, ChatTemplateLimitError, sandbox
from mtpserve.chat.sandbox import MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS
from mtpserve.tokenizer import Tokenizer

from ..support.ggufgen import write_gguf

HELLO = [{"role": "user", "content": "Hello"}]
PEAK_LIMIT = 64 * 2**20  # what a stopped render may have allocated (4 Mi-character strings on the way)


def render(source: str, messages=HELLO) -> str:
    return ChatTemplate(source).apply(messages).prompt


def stopped(source: str, match: str) -> tuple[float, int]:
    """Render `source`, expect the limit error matching `match`; (seconds taken, tracemalloc peak)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ChatTemplateLimitError, match=match) as err:
            render(source)
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert isinstance(err.value, ChatTemplateError) and isinstance(err.value, ValueError)
    assert str(err.value).startswith("chat template rendering stopped: ")
    assert sandbox._BUDGET.get() is None  # the per-render budget was reset
    return elapsed, peak


# --- time ------------------------------------------------------------------------------------------------


def test_the_limits_are_documented_constants():
    assert (MAX_RENDER_SECONDS, MAX_OUTPUT_CHARS, sandbox.MAX_INT_BITS) == (2.0, 4 * 2**20, 2**16)
    assert sandbox.MAX_PRINTED_CHARS == 4 * MAX_OUTPUT_CHARS
    doc = sandbox.__doc__
    assert all(name in doc for name in ("MAX_RENDER_SECONDS", "MAX_OUTPUT_CHARS", "MAX_PRINTED_CHARS", "MAX_INT_BITS"))


def test_a_loop_that_never_ends_is_stopped_within_3_s():
    # 10**10 empty iterations: no output, no call; the loop guard checks the clock at every item.
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHATML_TEMPLATE
    elapsed, _ = stopped(source, r"it ran for more than 2 s")
    assert MAX_RENDER_SECONDS <= elapsed < 3.0


@pytest.mark.parametrize(
    "source",
    [
        # Nested loops over a list (not range(), which the sandbox caps at 100000 items).
        "{% set l = range(100000)|list %}{% for i in l %}{% for j in l %}{% if i == j %}{% endif %}{% endfor %}{% endfor %}",
        # Loop bodies that only compute.
        "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i * j %}{% endfor %}{% endfor %}",
        # A recursive loop, two levels of 100000 below the top.
        "{% for x in [1] recursive %}{% if loop.depth < 3 %}{{ loop(range(100000)) }}{% endif %}{% endfor %}",
        # Filters over a big range, over and over.
        # (20000 a filter call: the stop is checked between calls, so one call's time bounds the overshoot)
        "{% for i in range(100000) %}{{ range(20000)|select('odd')|list|length and '' }}{% endfor %}",
    ],
    ids=["nested list loops", "computing loops", "recursive loop", "filters in a loop"],
)
def test_slow_templates_are_stopped(monkeypatch, source):
    monkeypatch.setattr(sandbox, "MAX_RENDER_SECONDS", 0.3)
    elapsed, _ = stopped(source, r"it ran for more than 0.3 s|would exceed")
    assert elapsed < 1.5


def test_range_beyond_the_sandbox_cap_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="Range too big"):
        render("{% for i in range(10**12) %}x{% endfor %}")


# --- size: the output and every value on the way, checked before it is allocated -------------------------

HUGE = [
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered prompt would exceed 4194304"),
    (
        "{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 64 + "{% endfor %}{% endfor %}",
        "the rendered prompt",
    ),
    ("{{ 'x' * 10**9 }}", r"a repetition \(\*\) would exceed"),
    ("{{ 10**10 * 'x' }}", r"a repetition \(\*\)"),
    ("{{ ['x'] * 10**9 }}", r"a repetition \(\*\)"),
    ("{% set s = 'x' * 4000000 %}{{ ([s] * 1000)|join|length }}", r"a repetition \(\*\)"),
    ("{% set s = 'x' * 4000000 %}{{ [s, s]|join|length }}", "the input of the 'join' filter"),
    ("{% set s = 'x' * 3000000 %}{{ ''.join([s, s])|length }}", r"a join\(\)"),
    ("{{ 'x'.ljust(10**9)|length }}", r"str.ljust\(\) with width 1000000000"),
    ("{{ 'x'.zfill(10**9)|length }}", r"str.zfill\(\)"),
    ("{{ 'x'|center(10**9)|length }}", "the 'center' filter with width"),
    ("{{ 'a\nb'|indent(10**9)|length }}", "the 'indent' filter"),
    ("{{ [1]|tojson(indent=10**9) }}", "the 'tojson' filter"),
    ("{{ '{:>1000000000}'.format(1)|length }}", "a formatted string"),
    ("{{ '{:>{w}}'.format(1, w=10**9)|length }}", "a formatted string with width"),
    ("{{ '%1000000000s' % 'x' }}", "a formatted string"),
    ("{{ '%*s' % (10**9, 'x') }}", "a formatted string with width"),
    ("{{ '%1000000000d'|format(1) }}", "a formatted string"),
    ("{% set s = 'x' * 3000 %}{{ s.replace('', s)|length }}", r"a replace\(\)"),
    ("{% set s = 'x' * 3000 %}{{ s|replace('x', s)|length }}", r"a replace\(\)"),
    ("{{ 'ab'.translate({97: 'x' * 4000000})|length }}", r"a translate\(\)"),
    ("{{ 10 ** (10**8) }}", "10 \\*\\* 100000000 has more than 65536 bits"),
    (
        "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "a product of more than",
    ),
    # Doubling: 40 rounds would be 1 TiB.
    (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "a ~ concatenation",
    ),
    (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "a \\+ concatenation",
    ),
    (
        "{% set ns = namespace(l=['x']) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
        "a \\+ concatenation",
    ),
    # A list holding itself twice, 80 levels deep: 2**80 elements when printed, a few hundred bytes in memory.
    (
        "{% set ns = namespace(l=[1]) %}{% for i in range(80) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
        "a printed value",
    ),
    (
        "{% set ns = namespace(l=[1]) %}{% for i in range(80) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l|tojson }}",
        "the input of the 'tojson'",
    ),
    (
        "{% set ns = namespace(l=[1]) %}{% for i in range(80) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l|string }}",
        "the input of the 'string'",
    ),
    (
        "{% set ns = namespace(l=[1]) %}{% for i in range(80) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns }}",
        "a printed value",
    ),
    (
        "{% set ns = namespace(l=[1]) %}{% for i in range(80) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ 'x' ~ ns.l }}",
        "a ~ concatenation",
    ),
    (
        "{% set ns = namespace(l=[1]) %}{% for i in range(80) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ '%s' % ns.l }}",
        "a formatted string",
    ),
    # Output captured in blocks and macros (joined by the environment's concat, never printed at once).
    (
        "{% set x %}{% for i in range(100000) %}" + "y" * 64 + "{% endfor %}{% endset %}{{ x|length }}",
        "a block of output",
    ),
    (
        "{% macro m() %}{% for i in range(100000) %}" + "y" * 64 + "{% endfor %}{% endmacro %}{{ m()|length }}",
        "a block of output",
    ),
    ("{% filter upper %}{% for i in range(100000) %}" + "y" * 64 + "{% endfor %}{% endfilter %}", "a block of output"),
    (
        "{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}{{ x|length }}",
        "the values printed in all",
    ),
    # Distinct 4 MiB values captured one after another: bounded by all the values printed, not by time.
    (
        "{% set s = 'y' * 4000000 %}{% set x %}{% for i in range(100000) %}{{ s ~ i }}{% endfor %}{% endset %}",
        "the values printed in all would exceed 16777216",
    ),
    # A namespace holding itself prints as "{...}" (repr's recursion guard): finite, and so is its size.
    (
        "{% set ns = namespace(x=1) %}{% set ns.me = ns %}{% for i in range(30) %}{% set ns.x = [ns, ns] %}{% endfor %}{{ ns }}",
        None,
    ),
]


@pytest.mark.parametrize(("source", "match"), HUGE, ids=[s for s, _ in HUGE])
def test_huge_output_is_stopped_before_it_is_allocated(source, match):
    if match is None:  # not huge after all: it renders
        assert len(render(source)) < MAX_OUTPUT_CHARS
        return
    elapsed, peak = stopped(source, match)
    assert elapsed < 2.0 and peak < PEAK_LIMIT, (elapsed, peak)


def test_sum_of_lists_is_linear():
    """Python's sum() of lists is quadratic (100000 one-item lists: 5e9 element copies, in one C call that no
    deadline interrupts); the filter concatenates instead (apply() renders 5 times: 3 probes and 2 prompts)."""
    start = time.perf_counter()
    assert render("{{ (range(100000)|batch(1)|sum(start=[]))|length }}") == "100000"
    assert time.perf_counter() - start < 5.0


def test_lipsum_is_gone():
    with pytest.raises(ChatTemplateError, match="'lipsum' is undefined"):
        render("{{ lipsum(n=10**6) }}")


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ 1" + "0" * 5000 + " }}", "Exceeds the limit"),
        ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "parsing error"),
    ],
    ids=["5000-digit literal", "5000 nested parentheses"],
)
def test_templates_that_cannot_compile_are_a_chat_template_error(source, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(source)


# --- ordinary templates are unaffected -----------------------------------------------------------------


def test_ordinary_templates_render_as_before():
    assert render(CHATML_TEMPLATE) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ '%s:%d|' % (m.role, loop.index) }}{{ '{}={}'.format(m.role, m.content|length) }}"
        "{{ ' ' ~ (m.content * 2)|center(12) ~ '|' ~ m.content.ljust(7, '.') ~ '|' }}"
        "{{ [m.content, m.role]|join(',') }}{{ m.content.replace('l', 'L') }}{{ ({'k': [1, 2]})|tojson }}"
        "{% endfor %}{{ ns.n }}{{ (range(3)|batch(2)|sum(start=[]))|list }}{{ 2 ** 10 }}"
    )
    assert render(source) == ('user:1|user=5  HelloHello |Hello..|Hello,userHeLLo{"k": [1, 2]}1[0, 1, 2]1024')


def test_a_prompt_near_the_limit_still_renders():
    """A 1M-token context is about 4M characters: the limits sit just above what a real prompt can be."""
    content = "word " * (3 * 2**20 // 5)  # 3 MiB of text
    prompt = render(CHATML_TEMPLATE, [{"role": "user", "content": content}])
    assert len(prompt) > 3 * 2**20


def test_renders_in_threads_have_their_own_deadline(monkeypatch):
    """The deadline lives in a context variable: a hostile render in one thread does not cut another short,
    and each render starts with a fresh budget."""
    monkeypatch.setattr(sandbox, "MAX_RENDER_SECONDS", 0.5)
    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    fast = ChatTemplate(CHATML_TEMPLATE)

    def normal_renders() -> int:
        n = 0
        end = time.perf_counter() + 0.8
        while time.perf_counter() < end:
            assert fast.apply(HELLO).prompt.startswith("<|im_start|>user")
            n += 1
        return n

    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(lambda: slow.apply(HELLO))
        normal = pool.submit(normal_renders)
        with pytest.raises(ChatTemplateLimitError, match="more than 0.5 s"):
            hostile.result()
        assert normal.result() > 0


def test_a_hostile_template_in_a_gguf(tmp_path):
    """End to end: the template comes from the file's tokenizer.chat_template."""
    path = tmp_path / "hostile.gguf"
    write_gguf(
        path,
        "llama",
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": ["a", "b", "ab", "<|endoftext|>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 3],
            "tokenizer.ggml.merges": ["a b"],
            "tokenizer.chat_template": "{% for m in messages %}{{ m.content * 10**9 }}{% endfor %}",
        },
    )
    template = ChatTemplate.for_tokenizer(Tokenizer.from_gguf(path))
    with pytest.raises(ChatTemplateLimitError, match=r"a repetition \(\*\) would exceed 4194304 characters"):
        template.apply(HELLO)
