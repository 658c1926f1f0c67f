"""Chat templates: the model's ``tokenizer.chat_template`` rendered in jinja2's immutable sandbox.

The environment matches HF transformers' ``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, a ``tojson`` that does not escape HTML, ``raise_exception``) so a template renders the
same text here as there. ``strftime_now`` is deliberately absent: a template's output must not depend on
the clock (templates that use it check ``strftime_now is defined`` and fall back to a fixed date).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InputError, TemplateError
from .fileio import sha256_bytes
from .gguf_file import ModelFile


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(f"chat template refused the messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """HF transformers' ``tojson`` filter: plain ``json.dumps``, unlike jinja2's HTML-escaping one."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, except that an unsafe attribute access fails at once instead of rendering
    as an empty string, so a template probing ``__class__`` & co. is reported, not silently half-run."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


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
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: messages file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read messages file ({_one_line(e)})") from None
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
    return validate_messages(messages, where=str(path))


class ChatTemplate:
    """A chat template compiled in the sandbox.

    source: the jinja2 text; hash: sha256 hex of its UTF-8 bytes.
    Raises TemplateError if the source does not compile.
    """

    def __init__(self, source: str):
        self.source = source
        self.hash = sha256_bytes(source.encode("utf-8"))
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

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, bos_token: str = "",
               eos_token: str = "", tools: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        """The prompt text for ``messages``, to be encoded with ``parse_special=True``.

        bos_token / eos_token: the texts the template may insert (HF passes the tokenizer's special tokens;
        if the template inserts BOS, encode without ``add_bos`` to avoid a double BOS).
        Raises InputError for malformed messages and TemplateError, one line, for any failure inside the
        template (undefined attribute, sandbox violation, ``raise_exception``, type error...).
        """
        validate_messages(messages)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                eos_token=eos_token, tools=tools,
            )  # fmt: skip
        except TemplateError:
            raise
        except jinja2.TemplateError as e:  # includes SecurityError and UndefinedError
            raise TemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None
        except Exception as e:  # a template can raise anything Python can (TypeError, ZeroDivisionError...)
            raise TemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None
