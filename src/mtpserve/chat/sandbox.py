"""The sandbox chat templates render in: jinja2's `ImmutableSandboxedEnvironment` (a template can read but not
change what it is given, nor reach Python internals) with the block trimming llama.cpp and Hugging Face use
(`trim_blocks`, `lstrip_blocks`), loop controls, and llama.cpp's helpers: `raise_exception`, `strftime_now`, and a
`tojson` that writes what llama.cpp's does (", " and ": " separators, key order kept, non-ASCII raw, floats as C++
prints them: 6 significant digits).

Every failure -- a template that does not compile, a render error, `raise_exception(...)`, messages or
tools of the wrong shape -- is one `ChatTemplateError` (a ValueError) that a server turns into HTTP 400.

Limits. A GGUF's template is untrusted code: besides the sandbox, every render is bounded in time and size
(`ChatTemplateLimitError`, a ChatTemplateError, says which limit stopped it):
* `MAX_RENDER_SECONDS` (2 s) per render, checked at every loop iteration (each `{% for %}`, and each
  `loop(items)` of a recursive one, iterates through a guard), call, filter, intercepted operator and output
  chunk; jinja2's `range` stays capped at 100000.
* `MAX_OUTPUT_CHARS` (4 Mi characters, about 1M tokens, well above any context served here): for the
  rendered prompt, for any value an expression prints, for every concatenation (`~`, `+`, joined buffers
  of macros and `{% set %}` blocks) and for what filters and calls take and give; `MAX_PRINTED_CHARS`
  (4 times that) for all the values one render prints, since captured output is buffered before it is
  joined.
* The operations whose cost a template controls with a number are checked *before* they run, so that they
  never allocate: `*` (`'x' * 10**9`), `**` and `*` on integers (at most `MAX_INT_BITS` bits), `%` and
  `format` widths, `ljust`/`center`/`zfill`/`expandtabs` and the `center`/`indent`/`batch`/`slice`/`tojson`
  widths, `replace`, `translate`, `join` and `sum` by the size of their result; a structure holding the same
  list many times over (`[l, l]` nested) is measured without being walked whole. `lipsum` is removed.
Left out: a template that stays under every limit but is slow per step still runs for up to 2 s.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import json
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer
from markupsafe import soft_str

from .errors import ChatTemplateError, ChatTemplateLimitError

MAX_RENDER_SECONDS = 2.0  # wall time of one render
MAX_OUTPUT_CHARS = 4 * 2**20  # the prompt, and any one value or concatenation on the way to it
MAX_PRINTED_CHARS = 4 * MAX_OUTPUT_CHARS  # all values a render prints, in captured blocks and macros too
MAX_INT_BITS = 2**16  # integers a template computes with `*` and `**` (printing stops at 4300 digits anyway)


class _Raised(Exception):
    """`raise_exception(...)` inside a template, carried out of jinja2 untouched."""


def compile_template(source: str) -> jinja2.Template:
    """A template compiled in the sandbox, every loop, call and operator guarded by the limits."""
    try:
        return _ENV.from_string(_LimitGuards().visit(_ENV.parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template parsing error: {e.message} (line {e.lineno})") from None
    except Exception as e:  # noqa: BLE001 -- e.g. a 5000-digit literal, nesting beyond the parser's recursion
        raise ChatTemplateError(f"chat template parsing error: {type(e).__name__}: {e}") from None


def render(template: jinja2.Template, context: Mapping[str, Any], now: dt.datetime) -> str:
    """One render within the limits; every failure is a ChatTemplateError."""

    def strftime_now(fmt: str) -> str:
        return now.strftime(fmt)

    token = _BUDGET.set(_Budget(time.monotonic() + MAX_RENDER_SECONDS))
    try:
        parts, size = [], 0
        for chunk in template.generate(**context, strftime_now=strftime_now):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise _too_big("the rendered prompt")
            _check_time()
            parts.append(chunk)
        return "".join(parts)
    except _Raised as e:
        raise ChatTemplateError(str(e)) from None
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - any template runtime error is the request's problem, never a crash
        raise ChatTemplateError(f"chat template rendering error: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)


# -- the Jinja environment -------------------------------------------------------------------------------


def to_json(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    """llama.cpp's `tojson` (common/jinja/value.cpp `value_to_json`): ", " / ": " separators (",\\n" with
    an indent), keys in insertion order, non-ASCII written raw, floats as C++ `<<` prints them. Positional
    arguments in llama.cpp's (and Hugging Face's) order: ensure_ascii, indent, separators, sort_keys."""
    if sort_keys:
        value = json.loads(json.dumps(value, sort_keys=True, default=_jsonable))
    item_sep = separators[0] if separators else ("," if indent is not None and indent >= 0 else ", ")
    key_sep = separators[1] if separators and len(separators) > 1 else ": "
    out: list[str] = []
    _write_json(out, value, 0, indent, item_sep, key_sep)
    text = "".join(out)
    return "".join(c if c.isascii() else json.dumps(c)[1:-1] for c in text) if ensure_ascii else text


def _write_json(out: list[str], value: Any, level: int, indent: int | None, item_sep: str, key_sep: str) -> None:
    newline = "\n" if indent is not None and indent >= 0 else ""
    pad = " " * (level * indent) if indent and indent > 0 else ""
    step = " " * indent if indent and indent > 0 else ""
    if value is None or isinstance(value, jinja2.Undefined):
        out.append("null")
    elif isinstance(value, bool):
        out.append("true" if value else "false")
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(_cpp_float(value))
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, Mapping):
        if not value:
            out.append("{}")
            return
        out.append("{" + newline)
        for i, (k, v) in enumerate(value.items()):
            out.append(pad + step + json.dumps(str(k), ensure_ascii=False) + key_sep)
            _write_json(out, v, level + 1, indent, item_sep, key_sep)
            out.append((item_sep if i < len(value) - 1 else "") + newline)
        out.append(pad + "}")
    elif isinstance(value, (list, tuple)):
        if not value:
            out.append("[]")
            return
        out.append("[" + newline)
        for i, v in enumerate(value):
            out.append(pad + step)
            _write_json(out, v, level + 1, indent, item_sep, key_sep)
            out.append((item_sep if i < len(value) - 1 else "") + newline)
        out.append(pad + "]")
    else:
        out.append("null")


def _cpp_float(x: float) -> str:
    """A double as `std::ostream << double` writes it (%g, 6 significant digits)."""
    if math.isnan(x):
        return "nan" if math.copysign(1.0, x) > 0 else "-nan"
    return f"{x:g}"


def _string(value: Any) -> str:
    """The `string` filter; a float reads as llama.cpp writes it (its `string` is `tojson` for numbers)."""
    return _cpp_float(value) if isinstance(value, float) else soft_str(value)


def _jsonable(value: Any) -> Any:
    return None if isinstance(value, jinja2.Undefined) else str(value)


def _raise_exception(message: str) -> None:
    raise _Raised(message)


# -- limits (see the module docstring) -------------------------------------------------------------------


@dataclass
class _Budget:
    """What one render may still spend: checked by every hook below, reset by `_Variant.render`."""

    deadline: float
    printed: int = 0  # characters of all values printed so far, in blocks and macros too


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)
_WIDTH_FILTERS = frozenset({"center", "indent", "batch", "slice", "tojson"})  # an int argument sizes the output
# Filters that neither turn their input into text nor give more than they take (`messages|length` in a loop
# must not measure the messages each time): no size checks for them.
_SIZE_NEUTRAL_FILTERS = frozenset(
    {
        "abs",
        "attr",
        "batch",
        "count",
        "d",
        "default",
        "dictsort",
        "first",
        "float",
        "groupby",
        "int",
        "items",
        "last",
        "length",
        "list",
        "map",
        "max",
        "min",
        "random",
        "reject",
        "rejectattr",
        "reverse",
        "round",
        "select",
        "selectattr",
        "slice",
        "sort",
        "unique",
    }
)
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
_NUMBERS = re.compile(r"\d+")
_END = object()


def _check_time() -> None:
    budget = _BUDGET.get()
    if budget is not None and time.monotonic() > budget.deadline:
        raise ChatTemplateLimitError(
            f"chat template rendering stopped: it ran for more than {MAX_RENDER_SECONDS:g} s (a loop that never ends?)"
        )


def _too_big(what: str, limit: int = MAX_OUTPUT_CHARS) -> ChatTemplateLimitError:
    return ChatTemplateLimitError(f"chat template rendering stopped: {what} would exceed {limit} characters")


def _is_container(v: Any) -> bool:
    return isinstance(v, (list, tuple, dict, set, frozenset, Namespace)) or (
        not isinstance(v, (str, int, float)) and isinstance(v, Mapping)
    )


def _leaf_size(v: Any) -> int:
    if isinstance(v, str):
        return len(v)
    if isinstance(v, int):
        return v.bit_length() // 3 + 1
    return 24  # floats, None, undefined, loop and macro objects: short reprs


def _flat_size(v: Any) -> int | None:
    """The size of a list/tuple of only strings or only numbers, counted in C; None for anything else."""
    if isinstance(v, (list, tuple)):
        types = set(map(type, v))
        if types <= {str}:
            return 2 + 2 * len(v) + sum(map(len, v))
        if types <= {int, bool}:
            return 2 + 3 * len(v) + sum(map(int.bit_length, v)) // 3
    return None


def _children(v: Any) -> tuple[int, Iterator[Any]]:
    """A container's own characters (brackets, separators) and its elements (keys and values of a mapping)."""
    if isinstance(v, Namespace):
        v = object.__getattribute__(v, "_Namespace__attrs")
    if isinstance(v, Mapping):
        return 2 + 4 * len(v), itertools.chain.from_iterable(v.items())
    return 2 + 2 * len(v), iter(v)


def _text_size(value: Any) -> int:
    """About how many characters `str(value)` has, counted only until it passes MAX_OUTPUT_CHARS. Every step
    adds at least 2, so a walk is at most MAX_OUTPUT_CHARS / 2 steps; a container met again (`[l, l]` nested
    80 deep is 2**80 elements when printed, a few kB in memory) is counted from a memo, not walked again."""
    if isinstance(value, str):
        return len(value)
    if not _is_container(value):
        return _leaf_size(value)
    flat = _flat_size(value)
    if flat is not None:
        return flat
    memo: dict[int, int] = {}
    base, items = _children(value)
    stack, on_stack, steps = [[value, items, base]], {id(value)}, 0  # frames: container, elements, size so far
    while True:
        frame = stack[-1]
        child = next(frame[1], _END)
        if child is _END:
            stack.pop()
            on_stack.discard(id(frame[0]))
            if len(memo) < 65536:
                memo[id(frame[0])] = frame[2]
            if not stack:
                return frame[2]
            stack[-1][2] += frame[2]
        elif not _is_container(child):
            frame[2] += _leaf_size(child)
        elif id(child) in memo:
            frame[2] += memo[id(child)]
        elif id(child) in on_stack:  # a namespace holding itself: repr() prints "{...}"
            frame[2] += 5
        elif (flat := _flat_size(child)) is not None:
            frame[2] += flat
        else:
            base, items = _children(child)
            stack.append([child, items, base])
            on_stack.add(id(child))
        if stack[-1][2] > MAX_OUTPUT_CHARS or (len(stack) > 1 and stack[-2][2] > MAX_OUTPUT_CHARS):
            return MAX_OUTPUT_CHARS + 1
        steps += 1
        if not steps & 4095:
            _check_time()


def _finalize(value: Any) -> Any:
    """Every printed value (`{{ }}`), wherever it goes: at most MAX_OUTPUT_CHARS each, MAX_PRINTED_CHARS in all
    (output captured by `{% set %}` blocks, macros and filter blocks is buffered before anything joins it)."""
    size = _text_size(value)
    if size > MAX_OUTPUT_CHARS:
        raise _too_big("a printed value")
    budget = _BUDGET.get()
    if budget is not None:
        budget.printed += size
        if budget.printed > MAX_PRINTED_CHARS:
            raise _too_big("the values printed in all", MAX_PRINTED_CHARS)
    return value


def _check_size(value: Any, what: str = "a value") -> Any:
    if _text_size(value) > MAX_OUTPUT_CHARS:
        raise _too_big(what)
    return value


def _check_widths(values: Iterable[Any], what: str) -> None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS:
            raise _too_big(f"{what} with width {v}")


def _check_format(fmt: str, args: Any) -> None:
    """`fmt % args`, `fmt.format(...)`: widths written in the format, `*` or nested widths from the args."""
    if any(len(n) > 7 and int(n) > MAX_OUTPUT_CHARS for n in _NUMBERS.findall(fmt)):
        raise _too_big("a formatted string")
    if "*" in fmt or re.search(r"\{[^{}]*\{", fmt):
        values = args.values() if isinstance(args, Mapping) else args if isinstance(args, (list, tuple)) else [args]
        _check_widths(values, "a formatted string")
    if _text_size(fmt) + _text_size(args) > MAX_OUTPUT_CHARS:
        raise _too_big("a formatted string")


def _check_replace(s: str, old: Any, new: Any, count: Any = -1) -> None:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    if len(s) + hits * (len(new) - len(old)) > MAX_OUTPUT_CHARS:
        raise _too_big("a replace()")


def _joined(items: Any, sep: Any) -> list[Any]:
    """`sep.join(items)` / `items|join(sep)`: the items as a list, after checking the size of the result."""
    items = list(items) if not isinstance(items, (list, tuple)) else items
    if _text_size(items) + len(soft_str(sep)) * len(items) > MAX_OUTPUT_CHARS:
        raise _too_big("a join()")
    return list(items)


def _guard_filter(name: str, fn: Any) -> Any:
    """A filter with the limits: its input and output sized, width arguments and result sizes checked first."""
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/environment comes first
    neutral = name in _SIZE_NEUTRAL_FILTERS

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        if len(args) <= skip:
            return fn(*args, **kwargs)
        value, rest = args[skip], args[skip + 1 :]
        if not neutral:
            _check_size(value, f"the input of the '{name}' filter")
        if name in _WIDTH_FILTERS:
            _check_widths([*rest, *kwargs.values()], f"the '{name}' filter")
        elif name == "format" and isinstance(value, str):
            _check_format(value, kwargs or rest)
        elif name == "replace":
            _check_replace(value, *rest[:3], **kwargs)
        elif name == "join":
            args = (*args[:skip], _joined(value, rest[0] if rest else kwargs.get("d", "")), *rest)
        elif name == "sum" and isinstance(kwargs.get("start", rest[1] if len(rest) > 1 else 0), (list, tuple)):
            return _sum_sequences(args[0], value, *rest, **kwargs)  # Python's sum() of lists is quadratic
        result = fn(*args, **kwargs)
        return result if neutral else _check_size(result, f"the output of the '{name}' filter")

    return guarded


def _sum_sequences(environment: Any, items: Any, attribute: Any = None, start: Any = ()) -> Any:
    if attribute is not None:
        items = map(make_attrgetter(environment, attribute), items)
    parts = [start, *items]
    _check_size(parts, "the output of the 'sum' filter")
    return type(start)(itertools.chain.from_iterable(parts))


class _LimitGuards(NodeTransformer):
    """Rewrites a parsed template: each `{% for %}` iterates through `environment.guarded_iter` (a deadline
    check per item: nested loops over lists are not range()s), each `~` goes through `checked_str_join`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("guarded_iter"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(
            nodes.EnvironmentAttribute("checked_str_join"), [nodes.Tuple(node.nodes, "load")], [], None, None
        )


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the render limits hooked into its operators, calls, filters, loops and output."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    @staticmethod
    def concat(parts: Iterable[str]) -> str:
        """Joins every buffer: macro and caller() results, `{% set %}...{% endset %}`, filter blocks."""
        parts = parts if isinstance(parts, list) else list(parts)
        if sum(map(len, parts)) > MAX_OUTPUT_CHARS:
            raise _too_big("a block of output")
        return "".join(parts)

    @staticmethod
    def guarded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            _check_time()
            yield item

    @staticmethod
    def checked_str_join(values: tuple[Any, ...]) -> str:
        _check_time()
        if sum(map(_text_size, values)) > MAX_OUTPUT_CHARS:
            raise _too_big("a ~ concatenation")
        return "".join(map(str, values))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS:
            raise ChatTemplateLimitError(
                f"chat template rendering stopped: {left} ** {right} has more than {MAX_INT_BITS} bits"
            )
        if operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise ChatTemplateLimitError(
                    f"chat template rendering stopped: a product of more than {MAX_INT_BITS} bits"
                )
            seq, n = (right, left) if isinstance(left, int) else (left, right)
            if (
                isinstance(n, int)
                and isinstance(seq, (str, list, tuple))
                and n > 0
                and _text_size(seq) * n > MAX_OUTPUT_CHARS
            ):
                raise _too_big("a repetition (*)")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if _text_size(left) + _text_size(right) > MAX_OUTPUT_CHARS:
                raise _too_big("a + concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_time()
        if isinstance(obj, jinja2.runtime.LoopContext) and args:  # `loop(items)` of a recursive for: guarded too
            args = (self.guarded_iter(args[0]), *args[1:])
        owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
        if isinstance(owner, str):  # a str method
            name = getattr(obj, "__name__", "")
            if name in _WIDTH_METHODS:
                _check_widths([*args, *kwargs.values()], f"str.{name}()")
            elif name == "replace":
                _check_replace(owner, *args[:3])
            elif name == "join" and args:
                args = (_joined(args[0], owner), *args[1:])
            elif name in ("format", "format_map"):  # the format string itself was checked by wrap_str_format
                _check_format(owner, kwargs or (args[0] if name == "format_map" and args else args))
            elif name == "translate" and args and isinstance(args[0], Mapping):
                longest = max((_text_size(v) for v in args[0].values()), default=0)
                if len(owner) * longest > MAX_OUTPUT_CHARS:
                    raise _too_big("a translate()")
        result = super().call(context, obj, *args, **kwargs)
        if isinstance(result, str) or _is_container(result):
            _check_size(result, "a call's result")
        return result

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(value.__self__, ())
        return wrapper


def _environment() -> ImmutableSandboxedEnvironment:
    env = _LimitedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        autoescape=False,
        finalize=_finalize,
    )
    env.filters["tojson"] = to_json
    env.filters["string"] = _string
    env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: dt.datetime.now().strftime(fmt)
    del env.globals["lipsum"]  # lipsum(n=10**6) writes n paragraphs in one call
    return env


_ENV = _environment()
