"""The jinja2 sandbox chat templates render in, and the budget of a render.

The environment matches HF transformers' ``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, a ``tojson`` that does not escape HTML, ``raise_exception``) in jinja2's immutable sandbox. A
template is code (from a model file, a user's file or a manifest anyone can reseal), so every render counts its
steps, the bytes of what it builds and its CPU time, and whatever can build far more than it is given is sized
before it runs (see _Sandbox).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import sys
import time
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from contextlib import contextmanager
from typing import Any, Callable, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.sandbox import (
    MAX_RANGE,
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
)
from jinja2.utils import Namespace
from markupsafe import Markup

from ..errors import TemplateError


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(f"chat template refused the messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """HF transformers' ``tojson`` filter: plain ``json.dumps``, unlike jinja2's HTML-escaping one."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# Render limits. A template is code from the model file (or a manifest, or a user's file): these stop one that
# loops (nearly) forever or builds huge values. Steps and bytes are counted, so a template renders or fails the
# same way on any machine; the CPU-time limit is a backstop far above what the step limit allows.
MAX_RENDER_CHARS = 16 * 1024 * 1024  # rendered text, and any one string or list a template builds or passes
MAX_RENDER_STEPS = 1_000_000  # template lines run (each loop iteration), Python calls, lookups, operators
MAX_RENDER_BYTES = 64 * 1024 * 1024  # total size of the strings and lists a render's operators, filters and calls make
MAX_RENDER_CPU_S = 1.0  # CPU seconds of the rendering thread
MAX_FOLD_BYTES = 64 * 1024  # a value jinja may compute while compiling a template (see _will_make)
_CPU_CHECK_EVERY = 1024  # steps between two looks at the thread's CPU clock


class _Budget:
    """Steps, bytes and CPU time left for one render (one per render: renders in other threads keep their own)."""

    def __init__(self) -> None:
        self.steps = 0
        self.bytes = 0
        self.cpu0 = time.thread_time()

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_RENDER_STEPS:
            raise TemplateError(
                f"chat template stopped: it ran more than {MAX_RENDER_STEPS:,} steps (a loop that does not end?)"
            )
        if self.steps % _CPU_CHECK_EVERY < n and time.thread_time() - self.cpu0 > MAX_RENDER_CPU_S:
            raise TemplateError(f"chat template stopped: it used more than {MAX_RENDER_CPU_S:g} s of CPU time")

    def allocate(self, value: Any) -> None:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.bytes += sys.getsizeof(value)
            if self.bytes > MAX_RENDER_BYTES:
                raise TemplateError(f"chat template stopped: it built more than {MAX_RENDER_BYTES // 2**20} MiB of strings and lists")

    def tracer(self, frame: Any, event: str, arg: Any) -> Any:
        """sys.settrace hook: every Python call counts one step; inside the compiled template every line does too,
        so loops jinja runs as plain Python ``for`` statements (over strings, lists, messages) are counted."""
        self.step()
        return self._in_template if frame.f_code.co_filename == "<template>" else None

    def _in_template(self, frame: Any, event: str, arg: Any) -> Any:
        self.step()
        return self._in_template


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("detinfer_template_budget", default=None)


@contextmanager
def render_budget() -> Iterator[None]:
    """The budget of one render in this thread: its steps, bytes and CPU time, every Python call traced against it
    (renders in other threads keep their own; the thread's previous trace function is restored after)."""
    budget = _Budget()
    token = _budget.set(budget)
    outer_trace = sys.gettrace()
    sys.settrace(budget.tracer)
    try:
        yield
    finally:
        sys.settrace(outer_trace)
        _budget.reset(token)


def _spend(n: int = 1) -> None:
    budget = _budget.get()
    if budget is not None:
        budget.step(n)


def _checked(value: Any, what: str) -> Any:
    """``value`` unless it is a string, list or int too large for a chat prompt (TemplateError naming ``what``)."""
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise TemplateError(f"chat template stopped: {what} made a value of length {len(value):,} (limit {MAX_RENDER_CHARS:,})")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER_CHARS:
        raise TemplateError(f"chat template stopped: {what} used the number {value} (limit {MAX_RENDER_CHARS:,})")
    return value


def _made(value: Any, what: str) -> Any:
    """A value the template just built: checked (see _checked) and counted against the render's bytes."""
    _checked(value, what)
    budget = _budget.get()
    if budget is not None:
        budget.allocate(value)
    return value


def _will_make(chars: int, what: str, nbytes: int = 0) -> None:
    """Refuse, before it is built, a value of up to ``chars`` characters (and ``nbytes`` bytes of list slots and
    objects) that would pass MAX_RENDER_CHARS, or the render's MAX_RENDER_BYTES with what it built so far.

    Outside a render the limit is MAX_FOLD_BYTES: jinja evaluates filters of constants when it compiles a template
    (and writes the results into the compiled code); one that fails there is left to the render and its budget."""
    budget = _budget.get()
    if budget is None and max(chars, nbytes) > MAX_FOLD_BYTES:
        raise TemplateError(f"chat template stopped: {what} is too large to fold when compiling")
    if chars > MAX_RENDER_CHARS:
        raise TemplateError(f"chat template stopped: {what} would make a value of length {chars:,} (limit {MAX_RENDER_CHARS:,})")
    if budget is not None and budget.bytes + max(chars, nbytes) > MAX_RENDER_BYTES:
        raise TemplateError(f"chat template stopped: {what} would build more than {MAX_RENDER_BYTES // 2**20} MiB of strings and lists")


def _quoted_size(s: str) -> int:
    """At most the characters of ``repr(s)`` or ``json.dumps(s)``: printable ASCII doubles at worst (backslashes,
    quotes), anything else is at most a 12-character escape (a surrogate pair)."""
    return 2 + (2 if s.isascii() and s.isprintable() else 12) * len(s)


def _text_size(value: Any, *, quoted: bool = False, per_item: int = 0, per_level: int = 0) -> int:
    """An upper bound of the characters ``str(value)`` makes (``repr``/JSON when ``quoted``; a container shows its
    items quoted), each item of a container adding ``per_item`` + ``per_level`` × its depth (JSON indentation).
    Counting stops once past MAX_RENDER_CHARS; each item visited costs a render step, so nothing is walked for long."""
    total = 0
    stack: list[tuple[Iterator[Any], int]] = [(iter((value,)), 0)]
    while stack:
        items, depth = stack[-1]
        for v in items:
            if isinstance(v, Namespace):
                v, total = object.__getattribute__(v, "_Namespace__attrs"), total + 13
            if isinstance(v, str):
                total += _quoted_size(v) if quoted or depth else len(v)
            elif isinstance(v, (list, tuple, dict, KeysView, ValuesView, ItemsView)):
                _spend(len(v))
                total += 2 + len(v) * (4 + per_item + per_level * (depth + 1))
                stack.append((iter(v.items() if isinstance(v, dict) else v), depth + 1))
            else:
                total += len(repr(v))  # numbers, None and the template's own small objects
            if total > MAX_RENDER_CHARS:
                return total
            if stack[-1][0] is not items:
                break
        else:
            stack.pop()
    return total


def _concat(parts: tuple) -> str:
    """The ``~`` operator (jinja's str_join), its length checked before the string is built."""
    _spend()
    _will_make(sum(_text_size(p) for p in parts), "'~'")
    return _made("".join([str(p) for p in parts]), "'~'")


def _join_output(parts: Any) -> str:
    """jinja's ``concat`` of a block's output (a macro, ``{% set %}...{% endset %}``, ``{% filter %}``), sized first."""
    parts = list(parts)
    _will_make(sum(map(len, parts)), "a block's output")
    return _made("".join(parts), "a block's output")


def _finalize(value: Any) -> Any:
    """Every ``{{ expression }}``'s value before jinja turns it into text: that text is sized first."""
    if not isinstance(value, str):
        _will_make(_text_size(value), "printing a value")
    return value


_DIGITS = re.compile(r"\d*")


def _printf_size(fmt: str, values: Any) -> int:
    """An upper bound of ``len(fmt % values)``, read with CPython's printf-style grammar (``%[(key)][flags][width|*]
    [.precision|*][hlL]conversion``, Objects/unicodeobject.c): the format's own length plus, per conversion, its
    width, precision and value. Stops at a conversion it cannot pair with a value: ``%`` itself raises there."""
    args = iter(values if isinstance(values, tuple) else (values,))
    size, i, n = len(fmt), 0, len(fmt)
    try:
        while (i := fmt.find("%", i) + 1) > 0:
            key = None
            if fmt.startswith("(", i):
                depth, j = 1, i + 1
                while j < n and depth:
                    depth += {"(": 1, ")": -1}.get(fmt[j], 0)
                    j += 1
                key, i = fmt[i + 1 : j - 1], j
            while i < n and fmt[i] in "-+ #0":
                i += 1
            numbers = []
            for lead in ("", "."):
                if lead and not fmt.startswith(".", i):
                    break
                i += len(lead)
                if fmt.startswith("*", i):
                    star = next(args)
                    numbers.append(star if isinstance(star, int) else 0)
                    i += 1
                else:
                    digits = _DIGITS.match(fmt, i).group()
                    numbers.append(int(digits or 0))
                    i += len(digits)
            i += fmt.startswith(("h", "l", "L"), i)
            conversion = fmt[i : i + 1]
            i += 1
            if conversion == "%":
                continue
            value = values[key] if key is not None else next(args)
            natural = len(repr(value)) + 330 if isinstance(value, (int, float)) else _text_size(value, quoted=conversion in "ra")
            size += sum(max(0, k) for k in numbers) + natural
            if size > MAX_RENDER_CHARS:
                break
    except (StopIteration, LookupError, TypeError, ValueError):
        pass
    return size


class _SizedFormatter(SandboxedFormatter):
    """jinja's sandboxed ``str.format``, each field sized before it is formatted: its value, the numbers of its
    spec (width, precision) and what the result holds so far."""

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self.made = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        _will_make(self.made + _text_size(value, quoted=conversion in ("r", "a")), "str.format")
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        _spend()
        widest = max(map(int, re.findall(r"\d+", format_spec)), default=0)
        _will_make(self.made + _text_size(value) + widest, "str.format")
        text = super().format_field(value, format_spec)
        self.made += len(text)
        return text


class _SizedEscapeFormatter(_SizedFormatter, SandboxedEscapeFormatter):
    """The same for ``Markup.format`` (which escapes its fields, as in HF transformers' environment)."""


class _CodeGenerator(CodeGenerator):
    """jinja's compiler, except that ``a ~ b`` calls :func:`_concat` (no autoescape here, so always plain str)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _CountedRange:
    """The template's ``range``: a range of at most MAX_RANGE items (as jinja's sandbox allows), each item
    counted against the render budget as it is iterated."""

    def __init__(self, *args: int):
        for a in args:
            _checked(a, "range()")
        self._r = range(*args)
        if len(self._r) > MAX_RANGE:
            raise TemplateError(f"chat template stopped: range() of {len(self._r):,} items (limit {MAX_RANGE:,})")

    def __iter__(self) -> Any:
        for i in self._r:
            _spend()
            yield i

    def __reversed__(self) -> Any:
        for i in reversed(self._r):
            _spend()
            yield i

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i: Any) -> Any:
        return self._r[i]

    def __contains__(self, x: Any) -> bool:
        return x in self._r


def _as_text(value: Any) -> int:
    return _text_size(value)


def _count(value: Any) -> int:
    """Items in a sized value (0 for one whose size cannot be known without consuming it)."""
    return len(value) if isinstance(value, (str, list, tuple, dict, range, _CountedRange)) else 0


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _lines(s: Any) -> int:
    """At least the lines ``str.splitlines`` cuts ``s`` into (each line break counted once, ``\\r\\n`` twice)."""
    return sum(map(s.count, "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")) + 1 if isinstance(s, str) else _as_text(s) + 1


def _replacing(s: Any, old: Any, new: Any, count: Any = None) -> int:
    if isinstance(s, str) and isinstance(old, str):
        hits = len(s) + 1 if old == "" else s.count(old)
    else:
        hits = _as_text(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return _as_text(s) + hits * max(0, _as_text(new) - (len(old) if isinstance(old, str) else 0))


def _joining(items: Any, sep: Any) -> int:
    return sum(map(_as_text, items)) + max(0, len(items) - 1) * _as_text(sep)


_OBJECT = 64  # bytes a small str or tuple object takes (and a list slot's 8), for lists of pieces
_CASE_GROWTH = 3  # str.upper / lower / title can turn one character into three (Unicode's special casing)


def _list_bytes(value: Any) -> int:
    """Bytes of a list made from ``value``: 8 per slot, and a new object per item of a non-ASCII str."""
    n = _count(value)
    return 8 * n + (_OBJECT * n if isinstance(value, str) and not value.isascii() else 0)


def _summing(iterable: Any, attribute: Any = None, start: Any = 0) -> tuple[int, int]:
    """sum() of lists copies every prefix: the items copied in total, and the bytes of the result."""
    copied, length = 0, _count(start)
    for item in iterable:
        length += _count(item)
        copied += length
        if copied > MAX_RENDER_CHARS:
            break
    return copied, 8 * length


def _escaped(s: Any) -> int:
    if not isinstance(s, str):
        return 6 * _as_text(s)
    return len(s) + 4 * (s.count("&") + s.count('"') + s.count("'")) + 3 * (s.count("<") + s.count(">"))


def _json_size(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> int:
    step = len(indent) if isinstance(indent, str) else _int(indent)
    seps = sum(map(_as_text, separators)) if isinstance(separators, (list, tuple)) else 0
    return _text_size(x, quoted=True, per_item=seps + (1 if indent is not None else 0), per_level=step)


# What a filter would build, (characters, bytes), from its arguments (as jinja2 3.1 names them, without the
# environment or context a filter is passed): computed before it runs. Filters not listed make at most a small
# multiple of what they are given, or a generator each item of which is a counted step.
_FILTER_SIZES: dict[str, Callable[..., tuple[int, int]]] = {
    "format": lambda value, *args, **kwargs: (_printf_size(str(value), kwargs or args), 0),
    "center": lambda value, width=80: (max(_as_text(value), _int(width)), 0),
    "indent": lambda s, width=4, first=False, blank=False: (
        _as_text(s) + _lines(s) * (1 + (len(width) if isinstance(width, str) else _int(width))), _OBJECT * _lines(s)),
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: (
        _as_text(s) + (_as_text(s) + 1) * (len(wrapstring) if isinstance(wrapstring, str) else 1), _OBJECT * _as_text(s)),
    "replace": lambda s, old, new, count=None: (_replacing(s, old, new, count), 0),
    "join": lambda value, d="", attribute=None: (_joining(value, d), 0),
    "truncate": lambda s, length=255, killwords=False, end="...", leeway=None: (_as_text(s) + _as_text(end), 0),
    "list": lambda value: (_count(value), _list_bytes(value)),
    "sort": lambda value, reverse=False, case_sensitive=False, attribute=None: (_count(value), _list_bytes(value)),
    "reverse": lambda value: (_count(value), _list_bytes(value) if not isinstance(value, str) else 0),
    "dictsort": lambda value, case_sensitive=False, by="key", reverse=False: (_count(value), _OBJECT * _count(value)),
    "string": lambda s: (_as_text(s), 0),
    "pprint": lambda value: (_text_size(value, quoted=True, per_item=1, per_level=1), 0),
    "tojson": lambda *args, **kwargs: (_json_size(*args, **kwargs), 0),
    "sum": lambda iterable, attribute=None, start=0: _summing(iterable, attribute, start),
    "batch": lambda value, linecount, fill_with=None: (_int(linecount), 8 * _int(linecount)),
    "e": lambda s: (_escaped(s), 0),
    "escape": lambda s: (_escaped(s), 0),
    "forceescape": lambda value: (_escaped(value), 0),
    "xmlattr": lambda d, autospace=True: (6 * _as_text(d), 0),
    "urlencode": lambda value: (12 * _as_text(value), 0),  # %XX for each of up to 4 UTF-8 bytes
    "urlize": lambda value, trim_url_limit=None, nofollow=False, target=None, rel=None, extra_schemes=None: (
        (3 + _as_text(target) + _as_text(rel) + 64) * (_as_text(value) + 1), _OBJECT * _as_text(value)),
    "upper": lambda s: (_CASE_GROWTH * _as_text(s), 0),
    "lower": lambda s: (_CASE_GROWTH * _as_text(s), 0),
    "capitalize": lambda s: (_CASE_GROWTH * _as_text(s), 0),
    "title": lambda s: (_CASE_GROWTH * _as_text(s), _OBJECT * _as_text(s)),
    "wordcount": lambda s: (0, _OBJECT * _as_text(s)),
    "striptags": lambda value: (_as_text(value), _OBJECT * _as_text(value)),
}
_MATERIALIZED = frozenset({"join", "list", "sum", "sort"})  # filters that read a generator whole: read into a list first

# The same for str methods a template calls (``s.replace(...)``), from (the string, the call's arguments).
_STR_METHOD_SIZES: dict[str, Callable[..., tuple[int, int]]] = {
    "join": lambda s, iterable: (_joining(iterable, s), 0),
    "replace": lambda s, old, new, count=-1: (_replacing(s, old, new, count), 0),
    "center": lambda s, width, fillchar=" ": (max(len(s), _int(width)), 0),
    "ljust": lambda s, width, fillchar=" ": (max(len(s), _int(width)), 0),
    "rjust": lambda s, width, fillchar=" ": (max(len(s), _int(width)), 0),
    "zfill": lambda s, width: (max(len(s), _int(width)), 0),
    "expandtabs": lambda s, tabsize=8: (len(s) + s.count("\t") * max(0, _int(tabsize)), 0),
    "split": lambda s, sep=None, maxsplit=-1: (len(s), _OBJECT * (s.count(sep) + 1 if isinstance(sep, str) and sep else len(s) + 1)),
    "rsplit": lambda s, sep=None, maxsplit=-1: (len(s), _OBJECT * (s.count(sep) + 1 if isinstance(sep, str) and sep else len(s) + 1)),
    "splitlines": lambda s, keepends=False: (len(s), _OBJECT * _lines(s)),
    "translate": lambda s, table: (len(s) * max([1, *(len(v) for v in table.values() if isinstance(v, str))]) if isinstance(table, dict) else len(s), 0),
    "encode": lambda s, encoding="utf-8", errors="strict": (0, 4 * len(s)),
    **{name: (lambda s: (_CASE_GROWTH * len(s), 0)) for name in ("upper", "lower", "title", "swapcase", "casefold", "capitalize")},
}


def _sized_call(sizes: Callable[..., tuple[int, int]], what: str, *args: Any, **kwargs: Any) -> None:
    """Refuse a call whose ``sizes`` (characters, bytes) are over budget; a call the size function cannot read
    (wrong arguments) is left to fail on its own, with its own message."""
    try:
        chars, nbytes = sizes(*args, **kwargs)
    except TypeError:
        return
    _will_make(chars, what, nbytes)


def _limited_filter(name: str, f: Any) -> Any:
    passes = getattr(f, "jinja_pass_arg", None) is not None  # the environment or context comes first
    sizes = _FILTER_SIZES.get(name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _spend()
        for a in (*args[1:], *kwargs.values()):
            _checked(a, "a filter argument")
        if sizes is not None:
            k = 1 if passes else 0
            if name in _MATERIALIZED and len(args) > k and isinstance(args[k], Iterator):
                args = (*args[:k], list(args[k]), *args[k + 1 :])
            _sized_call(sizes, f"the {name} filter", *args[k:], **kwargs)
        return _made(f(*args, **kwargs), f"the {name} filter")

    for attr in ("jinja_pass_arg",):  # pass_context / pass_environment markers must survive the wrapping
        if hasattr(f, attr):
            setattr(wrapper, attr, getattr(f, attr))
    return wrapper


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, except that an unsafe attribute access fails at once instead of rendering
    as an empty string, so a template probing ``__class__`` & co. is reported, not silently half-run.

    Every lookup, call, filter and arithmetic operator is counted and its result size checked (see the limits
    above); whatever can build a value much larger than its inputs (``*``, ``%``, ``~``, ``str.format``, the filters
    of _FILTER_SIZES and str methods of _STR_METHOD_SIZES, printing a value, a block's output) is sized before it runs.
    """

    intercepted_binops = frozenset({"+", "*", "**", "%", "//", "/", "-"})
    code_generator_class = _CodeGenerator
    concat_checked = staticmethod(_concat)
    concat = staticmethod(_join_output)

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _spend()
        return _checked(super().getattr(obj, attribute), "an attribute")

    def getitem(self, obj: Any, argument: Any) -> Any:
        _spend()
        return _checked(super().getitem(obj, argument), "an item")

    def wrap_str_format(self, value: Any) -> Any:
        """A string's ``format`` / ``format_map`` (jinja's wrapper, whose test this reuses) through _SizedFormatter."""
        if super().wrap_str_format(value) is None:
            return None
        owner, is_map = value.__self__, value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                args, kwargs = (), args[0]
            escaping = isinstance(owner, Markup)
            formatter = _SizedEscapeFormatter(self, escape=owner.escape) if escaping else _SizedFormatter(self)
            return type(owner)(formatter.vformat(owner, args, kwargs))

        return functools.update_wrapper(wrapper, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        _spend()
        for a in (*args, *kwargs.values()):
            _checked(a, "a call argument")
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str) and name in _STR_METHOD_SIZES:
            if name == "join" and args and isinstance(args[0], Iterator):
                args = (list(args[0]), *args[1:])
            _sized_call(_STR_METHOD_SIZES[name], f"str.{name}", owner, *args, **kwargs)
        return _made(super().call(__context, __obj, *args, **kwargs), "a call")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _spend()
        if operator == "**" and isinstance(right, int) and abs(right) > 64 and not isinstance(left, float):
            raise TemplateError(f"chat template stopped: exponent {right} is too large")
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                n = len(seq) * max(0, times)
                _will_make(n, "'*'", 8 * n if not isinstance(seq, str) else 0)
        if operator == "+" and isinstance(left, (str, list, tuple)) and type(left) is type(right):
            n = len(left) + len(right)
            _will_make(n, "'+'", 8 * n if not isinstance(left, str) else 0)
        if operator == "%" and isinstance(left, str):
            _will_make(_printf_size(left, right), "'%'")
        return _made(super().call_binop(context, operator, left, right), f"{operator!r}")


def environment() -> ImmutableSandboxedEnvironment:
    """A fresh sandbox with HF transformers' options, filters and globals, every operation counted and sized."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _CountedRange
    return env
