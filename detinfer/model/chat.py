"""Chat templates: the model's ``tokenizer.chat_template`` (or a jinja file, or a built-in format) rendered in
jinja2's immutable sandbox (model/sandbox.py, with its render budget).

The environment matches HF transformers' ``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, a ``tojson`` that does not escape HTML, ``raise_exception``) so a template renders the
same text here as there. ``strftime_now`` is deliberately absent: a template's output must not depend on
the clock (templates that use it check ``strftime_now is defined`` and fall back to a fixed date).

A model file without a template (Gemma 3 base) can still chat with ``--chat-template``: a jinja file, or the name
of a built-in format shipped as data in ``detinfer/templates/`` (llama.cpp's built-in formats of the same name,
src/llama-chat.cpp). Every kind renders through the same sandbox; where the text came from is ``origin``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import jinja2

from ..errors import InputError, TemplateError, json_kind
from ..fileio import parse_json, read_input, read_input_text, sha256_bytes, utf8_error
from .gguf_file import ModelFile
from .sandbox import MAX_RENDER_CHARS, environment, render_budget
from .tokenizer import Tokenizer

MAX_TEMPLATE_BYTES = 1024 * 1024  # a --chat-template file


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


ROLES = ("system", "user", "assistant", "tool")  # roles a conversation file or session may use


def validate_messages(messages: Any, *, where: str = "messages") -> list[dict[str, Any]]:
    """Check ``messages`` is a non-empty list of dicts with string ``role`` and string ``content``.

    Other keys are kept for templates that use them. Returns the list; raises InputError naming ``where``
    and the index of the first bad message (a role or content that is not valid UTF-8 included).
    """
    if not isinstance(messages, list):
        raise InputError(f"{where}: expected a list of {{role, content}} objects, got {json_kind(messages)}")
    if not messages:
        raise InputError(f"{where}: the list of messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"{where}: message {i} is {json_kind(m)}, expected an object with role and content")
        for key in ("role", "content"):
            if key not in m:
                raise InputError(f"{where}: message {i} has no {key!r}")
            if not isinstance(m[key], str):
                raise InputError(f"{where}: message {i} has a {key!r} that is {json_kind(m[key])}, expected a string")
            if (bad := utf8_error(m[key])) is not None:
                raise InputError(f"{where}: message {i}'s {key!r} is not valid UTF-8: {bad}")
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


def unanswered_tool_result(messages: list[dict[str, Any]]) -> int | None:
    """The index of the first tool message whose ``tool_call_id`` is not the id of a call in the nearest assistant
    message before it (OpenAI's rule: a tool result answers a call of the preceding assistant message), or None. A
    tool message without an id is not checked. No template renders the ids, so this is what ties a result to its
    call in a record."""
    calls: set[Any] = set()
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            calls = {c.get("id") for c in m.get("tool_calls") or [] if isinstance(c, dict)}
        elif m.get("role") == "tool" and m.get("tool_call_id") is not None and m["tool_call_id"] not in calls:
            return i
    return None


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
            self._template = environment().from_string(source)
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
        try:
            with render_budget():
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
