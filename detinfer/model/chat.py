"""Chat templates: the model's ``tokenizer.chat_template`` (or a jinja file, or a built-in format) rendered in
jinja2's immutable sandbox.

The environment matches HF transformers' ``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, a ``tojson`` that does not escape HTML, ``raise_exception``) so a template renders the
same text here as there. ``strftime_now`` is deliberately absent: a template's output must not depend on
the clock (templates that use it check ``strftime_now is defined`` and fall back to a fixed date).

A model file without a template (Gemma 3 base) can still chat with ``--chat-template``: a jinja file, or the name
of a built-in format shipped as data in ``detinfer/templates/`` (llama.cpp's built-in formats of the same name,
src/llama-chat.cpp). Every kind renders through the same sandbox; where the text came from is ``origin``.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Literal, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

from ..errors import InputError, TemplateError
from ..fileio import parse_json, read_input, read_input_text, sha256_bytes
from .gguf_file import ModelFile
from .tokenizer import Tokenizer


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


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
MAX_TEMPLATE_BYTES = 1024 * 1024  # a --chat-template file
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


def _concat(parts: tuple) -> str:
    """The ``~`` operator (jinja's str_join), its length checked before the string is built."""
    _spend()
    texts = [str(p) for p in parts]
    n = sum(map(len, texts))
    if n > MAX_RENDER_CHARS:
        raise TemplateError(f"chat template stopped: '~' made a value of length {n:,} (limit {MAX_RENDER_CHARS:,})")
    return _made("".join(texts), "'~'")


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


def _limited_filter(f: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _spend()
        for a in (*args[1:], *kwargs.values()):
            _checked(a, "a filter argument")
        return _made(f(*args, **kwargs), "a filter")

    for attr in ("jinja_pass_arg",):  # pass_context / pass_environment markers must survive the wrapping
        if hasattr(f, attr):
            setattr(wrapper, attr, getattr(f, attr))
    return wrapper


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, except that an unsafe attribute access fails at once instead of rendering
    as an empty string, so a template probing ``__class__`` & co. is reported, not silently half-run.

    Every lookup, call, filter and arithmetic operator is counted and its result size checked (see the limits above).
    """

    intercepted_binops = frozenset({"+", "*", "**", "%", "//", "/", "-"})
    code_generator_class = _CodeGenerator
    concat_checked = staticmethod(_concat)

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _spend()
        return _checked(super().getattr(obj, attribute), "an attribute")

    def getitem(self, obj: Any, argument: Any) -> Any:
        _spend()
        return _checked(super().getitem(obj, argument), "an item")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        _spend()
        for a in (*args, *kwargs.values()):
            _checked(a, "a call argument")
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in ("format", "format_map") and re.search(r"\d{8}", owner):
            raise TemplateError("chat template stopped: a format string asks for a width of 8 or more digits")
        return _made(super().call(__context, __obj, *args, **kwargs), "a call")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _spend()
        if operator == "**" and isinstance(right, int) and abs(right) > 64 and not isinstance(left, float):
            raise TemplateError(f"chat template stopped: exponent {right} is too large")
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
            _checked(len(left) * right, "'*'")
        if operator == "*" and isinstance(right, (str, list, tuple)) and isinstance(left, int):
            _checked(len(right) * left, "'*'")
        return _made(super().call_binop(context, operator, left, right), f"{operator!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _CountedRange
    return env


ROLES = ("system", "user", "assistant", "tool")  # roles a conversation file or session may use


def validate_messages(messages: Any, *, where: str = "messages") -> list[dict[str, Any]]:
    """Check ``messages`` is a non-empty list of dicts with string ``role`` and string ``content``.

    Other keys are kept for templates that use them. Returns the list; raises InputError naming ``where``
    and the index of the first bad message.
    """
    if not isinstance(messages, list):
        raise InputError(f"{where}: expected a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise InputError(f"{where}: the list of messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"{where}: message {i} is a {type(m).__name__}, expected an object with role and content")
        for key in ("role", "content"):
            if key not in m:
                raise InputError(f"{where}: message {i} has no {key!r}")
            if not isinstance(m[key], str):
                kind = type(m[key]).__name__
                raise InputError(f"{where}: message {i} has a {key!r} of type {kind}, expected a string")
    return messages


def load_messages(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a JSON file holding a list of ``{"role": ..., "content": ...}`` messages.

    Raises InputError naming the file and the problem: missing or unreadable file, invalid JSON (with line
    and column), or a bad message (with its index).
    """
    path = Path(path)
    messages = parse_json(read_input(path, InputError, "messages file", stdin=True), InputError, "messages file", path)
    messages = validate_messages(messages, where=str(path))
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise InputError(f"{path}: message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
    return messages


TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
# --chat-template NAME → file in TEMPLATES_DIR: llama.cpp's built-in formats for files without a template.
BUILTIN_TEMPLATES = {"gemma": "gemma.jinja", "chatml": "chatml.jinja", "chatml-tools": "chatml-tools.jinja"}
Origin = Literal["model", "file", "builtin"]


class ChatTemplate:
    """A chat template compiled in the sandbox.

    source: the jinja2 text; hash: sha256 hex of its UTF-8 bytes.
    origin: "model" (the file's ``tokenizer.chat_template``), "file" (a jinja file the user gave) or "builtin";
        name: the built-in's name or the file's name (None for the model's own).
    add_bos: how to encode the rendered text: False for model and file templates, which write any BOS themselves
        (``bos_token``, as HF templates do); None (the model's default) for built-ins, which like llama.cpp's leave
        BOS to the tokenizer.
    Raises TemplateError if the source does not compile.
    """

    def __init__(self, source: str, *, origin: Origin = "model", name: str | None = None):
        self.source = source
        self.hash = sha256_bytes(source.encode("utf-8"))
        self.origin: Origin = origin
        self.name = name
        self.add_bos: bool | None = None if origin == "builtin" else False
        self._renders_tools: bool | None = None
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile: line {e.lineno}: {_one_line(e)}") from None
        except Exception as e:  # jinja2 raises TemplateAssertionError, etc.
            raise TemplateError(f"chat template does not compile: {_one_line(e)}") from None

    @classmethod
    def from_model(cls, mf: ModelFile) -> ChatTemplate | None:
        """The template in ``tokenizer.chat_template``, or None if the file has none."""
        source = mf.get("tokenizer.chat_template")
        if source is None:
            return None
        if not isinstance(source, str):
            raise TemplateError(f"{mf.path.name}: tokenizer.chat_template is a {type(source).__name__}, not text")
        return cls(source)

    @classmethod
    def builtin(cls, name: str) -> ChatTemplate:
        """The built-in format ``name`` (a key of BUILTIN_TEMPLATES); TemplateError listing them if unknown."""
        if name not in BUILTIN_TEMPLATES:
            raise TemplateError(f"no built-in chat format {name!r}; built-in formats: {', '.join(BUILTIN_TEMPLATES)}")
        return cls((TEMPLATES_DIR / BUILTIN_TEMPLATES[name]).read_text(encoding="utf-8"), origin="builtin", name=name)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ChatTemplate:
        """A jinja chat template read from ``path`` (UTF-8); InputError if unreadable, TemplateError if it does not compile."""
        path = Path(path)
        if not os.path.lexists(path):
            raise InputError(f"chat template {str(path)!r} is neither a file nor a built-in format ({', '.join(BUILTIN_TEMPLATES)})")
        return cls(read_input_text(path, InputError, "chat template", max_bytes=MAX_TEMPLATE_BYTES), origin="file", name=path.name)

    @classmethod
    def from_option(cls, value: str) -> ChatTemplate:
        """``--chat-template VALUE``: a built-in format's name (these win), else a path to a jinja file."""
        return cls.builtin(value) if value in BUILTIN_TEMPLATES else cls.from_file(value)

    @classmethod
    def from_record(cls, origin: Origin, name: str | None, source: str, sha256: str) -> ChatTemplate:
        """The template a manifest recorded, from its recorded text; TemplateError if the text does not hash to ``sha256``."""
        template = cls(source, origin=origin, name=name)
        if template.hash != sha256:
            raise TemplateError(f"the recorded chat template text has sha256 {template.hash}, but {sha256} was recorded")
        return template

    def renders_tools(self) -> bool:
        """Whether ``tools`` change the rendered prompt (a template without tool support ignores them)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "x"}]
            tool = {"type": "function", "function": {"name": "probe", "description": "d", "parameters": {"type": "object", "properties": {}}}}
            self._renders_tools = self.render(probe, tools=[tool]) != self.render(probe)
        return self._renders_tools

    def render_with(self, tokenizer: Tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        """:meth:`render` with ``tokenizer``'s BOS and EOS texts as ``bos_token`` / ``eos_token`` (as HF passes them);
        the one prompt renderer of runs, sessions and the server. Raises like :meth:`render`."""
        tok = tokenizer
        return self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                           eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")  # fmt: skip

    def encode(self, tokenizer: Tokenizer, rendered: str) -> list[int]:
        """Token ids of a whole rendered prompt: special tokens parsed, BOS as :attr:`add_bos` says."""
        return tokenizer.encode(rendered, add_bos=self.add_bos, parse_special=True)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, bos_token: str = "",
               eos_token: str = "", tools: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        """The prompt text for ``messages``, to be encoded with ``parse_special=True``.

        bos_token / eos_token: the texts the template may insert (HF passes the tokenizer's special tokens;
        if the template inserts BOS, encode without ``add_bos`` to avoid a double BOS).
        Raises InputError for malformed messages and TemplateError, one line, for any failure inside the
        template (undefined attribute, sandbox violation, ``raise_exception``, type error...).
        """
        validate_messages(messages)
        budget = _Budget()
        token = _budget.set(budget)
        outer_trace = sys.gettrace()
        sys.settrace(budget.tracer)  # this thread only: renders in other threads keep their own budget
        try:
            parts, n = [], 0
            for part in self._template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                eos_token=eos_token, tools=tools,
            ):  # fmt: skip
                n += len(part)
                if n > MAX_RENDER_CHARS:
                    raise TemplateError(f"chat template stopped: the rendered prompt passed {MAX_RENDER_CHARS:,} characters")
                parts.append(part)
            return "".join(parts)
        except TemplateError:
            raise
        except (RecursionError, MemoryError) as e:
            raise TemplateError(f"chat template failed: {type(e).__name__}: it recursed too deep or used too much memory") from None
        except jinja2.TemplateError as e:  # includes SecurityError and UndefinedError
            raise TemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None
        except Exception as e:  # a template can raise anything Python can (TypeError, ZeroDivisionError...)
            raise TemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            sys.settrace(outer_trace)
            _budget.reset(token)
