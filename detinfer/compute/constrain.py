"""Constrained decoding: a grammar masks the logits before each sampled token, so the output always parses.

A :class:`Constraint` (a JSON Schema, any JSON object, a regex or a Lark grammar, with its full text and sha256)
compiles with llguidance (the structured-generation library of llama.cpp, vLLM and SGLang) against the model's
vocabulary into a :class:`Guide`. Before each sampled token the guide's allowed-token mask sets every disallowed
logit to -inf; the sampler then applies its documented rules unchanged (greedy ties to the lowest id, top-p, the
seeded draw), and the chosen token is fed back to the matcher. The end-of-generation tokens are allowed exactly
when the grammar accepts, so a constrained generation ends with one of them (when the grammar can go no further
it is the only token left) — or at max_tokens / the end of the context, like any other.

The mask at a step is a pure function of (grammar, tokens generated so far): llguidance keeps no clocks or
randomness, only deterministic work limits. Replaying the same constraint therefore rebuilds the same masks;
each step's mask is hashed into a chain (:func:`mask_digest`) recorded beside the raw-logits digests.

llguidance's token trie is built from detinfer's own token bytes (``Tokenizer.token_bytes``, llama.cpp's
``token_to_piece``), the route llguidance's llama.cpp binding takes, with control tokens marked special so that no
grammar can spell them out of text. Nor can a grammar name them: a Lark grammar naming one (``<|im_start|>``, a
token-id range ``<[1]>``) is refused when it is checked, and no mask allows a control token other than the
end-of-generation ones, whatever the grammar.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ConstraintError, ManifestError, json_kind
from ..fileio import parse_json, read_input_text, utf8_error
from ..model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_CONSTRAINT_BYTES = 64 * 1024  # UTF-8 bytes of a constraint's text: bigger schemas/grammars are refused
JSON_OBJECT_SCHEMA = {"type": "object"}  # what kind "json_object" enforces: any JSON object
MASK_DIGEST_SEED = hashlib.sha256(b"detinfer-mask/1").hexdigest()
# Parser work limits: deterministic counters (not clocks); verbose errors would dump parser state into messages.
# llguidance checks a row's Earley items (2,000 by default) only when a token is consumed, after the first mask was
# computed: a wide grammar (a rule with thousands of alternatives, well under the size cap) compiled, then failed
# at its first token. A row may hold as many items as one mask computation may make (step_max_items), so the
# limit left is the one the first mask (computed when the Guide is built) exercises; per-token work stays bounded.
_STEP_MAX_ITEMS = 50_000  # llguidance's default
PROBE_TOKENS = 8  # tokens of the trial decode a Guide runs when it is built (see Guide._probe)


@functools.cache
def _ll():
    """llguidance and its parser limits, imported when a constraint is first used (a plain run need not pay for it)."""
    import llguidance

    limits = llguidance.LLParserLimits(verbose_errors=False, step_max_items=_STEP_MAX_ITEMS, max_items_in_row=_STEP_MAX_ITEMS)
    return llguidance, limits


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Constraint(BaseModel):
    """A grammar the output must match: ``kind`` (json_schema, json_object, regex, lark), its full ``text`` (the
    schema as JSON text, the regex, the Lark source; "" for json_object) and ``sha256`` (of the UTF-8 text).

    Build with :meth:`create` (checks the size cap and JSON syntax); :meth:`check` compiles it against a tokenizer.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_schema", "json_object", "regex", "lark"]
    text: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @classmethod
    def create(cls, kind: str, text: str = "", *, source: str | None = None) -> "Constraint":
        """A constraint of ``kind`` with ``text``. Raises ConstraintError for an unknown kind, text that is not valid
        UTF-8 (a lone surrogate: an undecodable byte of a command-line argument, or a ``\\ud800`` escape), text over
        MAX_CONSTRAINT_BYTES, text that is not a JSON object (json_schema) or any text with json_object. ``source``
        (e.g. ``"--regex"``) names where the text came from in those messages."""
        if kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {kind!r}; use one of {', '.join(KINDS)}")
        what = source or f"the {kind} constraint"
        if (bad := utf8_error(text)) is not None:
            raise ConstraintError(f"{what} is not valid UTF-8: {bad}")
        size = len(text.encode("utf-8"))
        if size > MAX_CONSTRAINT_BYTES:
            raise ConstraintError(f"{what} is {size:,} bytes; the cap is {MAX_CONSTRAINT_BYTES:,} bytes (simplify it)")
        if kind == "json_object" and text:
            raise ConstraintError("a json_object constraint has no text; use json_schema to give a schema")
        if kind == "json_schema":
            named = f"{source}: " if source else ""  # the file's name, before what is wrong with it
            try:
                schema = parse_json(text, ConstraintError, "JSON Schema")
            except ConstraintError as e:
                raise ConstraintError(f"{named}{e}") from None
            check_schema_object(schema, named)
        return cls(kind=kind, text=text, sha256=text_sha256(text))

    @classmethod
    def from_file(cls, kind: str, path: str | Path, *, source: str | None = None) -> "Constraint":
        """:meth:`create` from a UTF-8 file, read like every input (fileio.read_input_text: a regular file, at most
        MAX_CONSTRAINT_BYTES, so a FIFO or /dev/zero is refused at once); ConstraintError if it cannot be read or
        decoded. ``source`` (e.g. ``"--grammar"``) names the file in messages."""
        what = f"{source or kind} file"
        return cls.create(kind, read_input_text(path, ConstraintError, what, max_bytes=MAX_CONSTRAINT_BYTES), source=f"{what} {path}")

    def check_sha256(self) -> None:
        """ManifestError if ``sha256`` is not the hash of ``text`` (an edited record)."""
        if text_sha256(self.text) != self.sha256:
            raise ManifestError(f"constraint.sha256 {self.sha256[:16]}... is not the sha256 of constraint.text; the record was edited")

    def grammar(self) -> str:
        """The llguidance grammar (JSON text) for this constraint."""
        matcher = _ll()[0].LLMatcher
        if self.kind == "lark":
            return matcher.grammar_from_lark(self.text)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.text)
        return matcher.grammar_from_json_schema(self.text if self.kind == "json_schema" else JSON_OBJECT_SCHEMA)

    def check(self, tokenizer: Tokenizer) -> None:
        """Compile against ``tokenizer`` and discard: ConstraintError (naming the problem) before any token."""
        Guide(self, tokenizer)


def check_ignore_eos(constraint: Constraint | None, ignore_eos: bool) -> None:
    """ConstraintError for a constraint with ignore_eos: a constrained output ends with an end-of-generation token."""
    if constraint is not None and ignore_eos:
        raise ConstraintError("a constraint ends its output with an end-of-generation token; drop --ignore-eos")


def check_schema_object(schema: Any, named: str = "") -> None:
    """ConstraintError unless a parsed JSON Schema is a JSON object (``named``: what holds it, before the reason)."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"{named}a JSON Schema must be a JSON object, got {json_kind(schema)}")


def json_schema_constraint(schema: Any) -> Constraint:
    """A json_schema constraint from a parsed schema (its keys kept in order: properties are generated in it).
    ConstraintError for a schema that is not a JSON object, not JSON data (a set, a cycle) or nested too deeply to
    serialize, besides :meth:`Constraint.create`'s."""
    check_schema_object(schema)
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise ConstraintError("the JSON Schema is nested too deeply to serialize") from None
    except (TypeError, ValueError) as e:  # not JSON data, or a circular reference
        raise ConstraintError(f"the JSON Schema is not JSON data: {e}") from None
    return Constraint.create("json_schema", text)


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function name


def _tool_function(tool: Any, i: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ConstraintError(f"tools[{i}] is not a function tool with a name ({{'type': 'function', 'function': {{'name': ...}}}})")
    if not TOOL_NAME.fullmatch(fn["name"]):
        raise ConstraintError(f"tools[{i}] is named {fn['name'][:80]!r}; a function name is 1 to 64 letters, digits, '_' "
                              "or '-' (OpenAI's rule), so no name can hold call markup")
    return fn


def check_tools(tools: list[Any]) -> list[dict]:
    """The ``function`` objects of OpenAI-style ``tools``; ConstraintError (one line, naming the tool) for one that is
    not a function tool with a name, or whose name is not an OpenAI function name (``^[a-zA-Z0-9_-]{1,64}$``)."""
    return [_tool_function(t, i) for i, t in enumerate(tools)]


def tool_call_constraint(tools: list[dict], name: str | None = None, prefix: str = "", suffix: str = "",
                         arguments_key: str = "arguments") -> Constraint:
    """A constraint for exactly one tool call ``{"name": NAME, ARGUMENTS_KEY: {...}}`` whose arguments validate
    against that tool's JSON Schema (``function.parameters``; any object if absent), optionally between literal markup.

    ``tools``: OpenAI-style ``[{"type": "function", "function": {"name", "parameters"}}, ...]``. ``name``: only that
    function may be called (else any of them: anyOf over the tools). ``prefix`` / ``suffix``: literal text around the
    JSON object (e.g. ``"<tool_call>\\n"``, ``"\\n</tool_call>"``); ``arguments_key``: ``"parameters"`` for Llama 3's format. Without markup the constraint is kind json_schema;
    with it, kind lark (``start: PREFIX call SUFFIX``, ``call: %json {schema}``). Raises ConstraintError for no tools,
    a tool without a name or with one that is not an OpenAI function name (:func:`check_tools`), or a ``name`` that
    is not among them.
    """
    if not tools:
        raise ConstraintError("a tool call constraint needs at least one tool")
    functions = check_tools(tools)
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ConstraintError(f"tool_choice names function {name!r}, which is not among the tools")
    calls = [
        {"type": "object", "properties": {"name": {"const": f["name"]}, arguments_key: f.get("parameters") or {"type": "object"}},
         "required": ["name", arguments_key], "additionalProperties": False}
        for f in functions
    ]  # fmt: skip
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if not prefix and not suffix:
        return json_schema_constraint(schema)
    literal = lambda text: [json.dumps(text, ensure_ascii=False)] if text else []  # noqa: E731 (a Lark string)
    body = " ".join(literal(prefix) + ["call"] + literal(suffix))
    return Constraint.create("lark", f"start: {body}\ncall: %json {json.dumps(schema, ensure_ascii=False)}\n")


# --------------------------------------------------------------------------------------------- matching

_LL_TOKENIZERS: dict[str, llguidance.LLTokenizer] = {}
_LL_LOCK = threading.Lock()


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes, special ids, EOS/BOS and an encoder."""

    def __init__(self, tokenizer: Tokenizer, eos: list[int]):
        self.tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False)


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ``tokenizer`` (its token trie; ~0.2 s for 49k tokens), built once per tokenizer
    hash. The end-of-generation ids are its EOS set. ConstraintError if the model has no end-of-generation token."""
    with _LL_LOCK:
        ll = _LL_TOKENIZERS.get(tokenizer.hash)
        if ll is None:
            eos = sorted(tokenizer.eog_ids)
            if not eos:
                raise ConstraintError("this model has no end-of-generation token, so a constrained output could never end")
            llg = _ll()[0]
            ll = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, eos)), eos_token=eos)
            _LL_TOKENIZERS[tokenizer.hash] = ll
        return ll


# llguidance's Lark dialect names tokens, not text, with token lexemes: a special token by name (``<|im_start|>``) or
# token ids (``<[1]>``, ``<[0-20,99]>``, ``<[^5]>``, ``<[*]>``). They are found as its lexer finds them
# (parser/src/lark/lexer.rs): outside strings, regexes and comments.
_LARK_LEXEMES = re.compile(r'"(?:\\.|[^"\\])*"i?|/(?:\\.|[^/\\])+/[imslux]*|(?:#|//)[^\n]*|(<[^<>\s]+>)')
_TOKEN_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def _in_token_range(body: str, token: int) -> bool | None:
    """Whether the token-id lexeme ``<[body]>`` admits ``token``; None if ``body`` is not a range llguidance reads."""
    negate = body.startswith("^")
    body = body.removeprefix("^")
    if body == "*":
        return not negate
    hit = False
    for part in body.split(","):
        m = _TOKEN_RANGE.fullmatch(part)
        if m is None:
            return None
        hit |= int(m[1]) <= token <= int(m[2] or m[1])
    return hit != negate


def refuse_control_tokens(constraint: Constraint, tokenizer: Tokenizer) -> None:
    """ConstraintError for a Lark grammar that names a control token (``tokenizer.special_ids``, end-of-generation
    tokens included): by name, or in a token-id range. A constraint describes text; end-of-generation tokens end
    the output where the grammar accepts without being named. llguidance compiling the grammar without a
    vocabulary warns about every token lexeme it meets, which backs up the scan that names them."""
    if constraint.kind != "lark":
        return
    llg, limits = _ll()
    ok, messages = llg.LLMatcher.validate_grammar_with_warnings(constraint.grammar(), None, limits=limits)
    warned = [m for m in messages if "can't validate <" in m] if not ok else []
    if not warned:
        return
    control = sorted(tokenizer.special_ids)
    for m in _LARK_LEXEMES.finditer(constraint.text):
        lexeme = m[1]
        if lexeme is None:
            continue
        if not (lexeme.startswith("<[") and lexeme.endswith("]>")):
            raise ConstraintError(f"the lark grammar names the control token {lexeme}; a constraint never produces control "
                                  "tokens (the output ends with an end-of-generation token where the grammar accepts): remove it")
        named = [t for t in control if _in_token_range(lexeme[2:-2], t)]
        if named:
            raise ConstraintError(f"the lark grammar's token range {lexeme} includes the control token {named[0]} "
                                  f"{tokenizer.token_text(named[0])!r}; a constraint never produces control tokens: leave them out")
    if any("<special_token>" in m or "<any_token>" in m for m in warned):  # one the scan above did not find
        raise ConstraintError("the lark grammar names a control token; a constraint never produces control tokens: remove it")


# llguidance's report of a regex that does not parse (a --regex, a Lark /regex/ or a schema's "pattern"): where it is
# in the grammar, the regex quoted, then the regex crate's excerpt, caret line and reason
_REGEX_ERROR = re.compile(r'(?:(?P<at>at \d+\(\d+\): )invalid regex (?P<quoted>".*") \(in regex\): )?regex parse error:\n'
                          r'(?P<source>.*?)\n(?:[ \t]*\^[ \t^-]*\n)?error: (?P<why>[^\n]*)', re.S)


def _one_line(message: str, kind: str = "") -> str:
    """llguidance's multi-line error (with source excerpts and carets) as one line. A regex that does not parse reads
    'regex "[a-": unclosed character class', after its place in a Lark grammar; a ``kind`` "regex" has no place (its
    grammar is llguidance's one-line wrapper of the regex)."""
    if m := _REGEX_ERROR.search(message):
        at = m["at"] if m["at"] and kind != "regex" else ""
        return f"{at}regex {m['quoted'] or json.dumps(m['source'].strip())}: {m['why'].strip()}"
    keep = [s for line in message.splitlines() if (s := line.strip()) and not s.startswith("^") and not re.match(r"^\d+ \|", s)]
    return " ".join(keep)


def mask_digest(previous: str, allowed: np.ndarray) -> str:
    """Next link of the mask digest chain: sha256(previous digest bytes || the mask as bits, token i = bit i % 8 of
    byte i // 8, ceil(n_vocab / 8) bytes)."""
    return hashlib.sha256(bytes.fromhex(previous) + np.packbits(allowed, bitorder="little").tobytes()).hexdigest()


def control_ids(tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(int64 ids of the control tokens that never end a generation, int64 end-of-generation ids): what a mask
    never allows, and what it allows only where the grammar accepts."""
    return (np.array(sorted(tokenizer.special_ids - tokenizer.eog_ids), np.int64),
            np.array(sorted(tokenizer.eog_ids), np.int64))  # fmt: skip


class Guide:
    """One constrained generation: an llguidance matcher advanced token by token, and its mask digest chain.

    No mask allows a control token other than the end-of-generation ones, and those only where the grammar accepts,
    whatever the grammar (a token-id range included).

    Raises ConstraintError at construction for an invalid or unsupported schema / regex / grammar (llguidance's
    message, one line), a Lark grammar naming a control token, one that allows no output at all, or one past the
    parser's limits within its first PROBE_TOKENS tokens.
    """

    def __init__(self, constraint: Constraint, tokenizer: Tokenizer):
        self.constraint = constraint
        self.n_vocab = tokenizer.n_vocab
        self.n_consumed = 0
        refuse_control_tokens(constraint, tokenizer)
        self._control, self._eog = control_ids(tokenizer)
        llg, limits = _ll()
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer), constraint.grammar(), log_level=0, limits=limits)
        self.digest = MASK_DIGEST_SEED
        self._fail(f"invalid {constraint.kind} constraint")
        self._first = self._allowed(self.matcher)  # an empty language errors here, before any token is generated
        self._fail(f"the {constraint.kind} constraint can never be satisfied")
        if not self._first[: self.n_vocab].any():
            raise ConstraintError(f"the {constraint.kind} constraint allows no output")
        self._probe()

    def _fail(self, what: str, matcher: llguidance.LLMatcher | None = None) -> None:
        matcher = matcher or self.matcher
        if matcher.is_error():
            raise ConstraintError(f"{what}: {_one_line(matcher.get_error(), self.constraint.kind)}")

    def _allowed(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").view(np.bool_)
        allowed[self._control] = False
        if allowed[self._eog].any() and not matcher.is_accepting():
            allowed[self._eog] = False
        return allowed

    def _probe(self) -> None:
        """A trial decode on a copy of the matcher: PROBE_TOKENS tokens, each the lowest id allowed that does not end
        the output (in byte-level and SentencePiece vocabularies, single bytes). llguidance's per-step limits are
        met in states the first mask does not visit: a schema whose wide alternatives open behind a bracket
        compiles, then fails a token in. This walks a few bytes into the grammar so such a one fails here, before
        any token; the masks of the generation itself are untouched."""
        matcher, allowed = self.matcher.deep_copy(), self._first
        for step in range(PROBE_TOKENS):
            ids = np.flatnonzero(allowed[: self.n_vocab])
            ids = ids[~np.isin(ids, self._eog)]
            if ids.size == 0:
                return
            what = f"the {self.constraint.kind} constraint exceeds the parser's limits at token {step + 1} of a trial decode"
            matcher.consume_token(int(ids[0]))
            self._fail(what, matcher)
            allowed = self._allowed(matcher)
            self._fail(what, matcher)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """float32[n_vocab] logits with every token the grammar does not allow next set to -inf (a new array); extends
        the mask digest chain. ConstraintError if the grammar allows no token (it cannot be completed)."""
        allowed = self._first if self._first is not None else self._allowed(self.matcher)
        self._first = None
        n = logits.shape[0]
        allowed = np.concatenate([allowed, np.zeros(max(0, n - allowed.shape[0]), np.bool_)])[:n]
        self._fail("the constraint failed")
        if not allowed.any():
            raise ConstraintError(f"the {self.constraint.kind} constraint allows no next token; it cannot be completed")
        self.digest = mask_digest(self.digest, allowed)
        return np.where(allowed, logits, np.float32(-np.inf))

    def consume(self, token: int) -> None:
        """Advance past a sampled ``token`` (an allowed one); end-of-generation tokens end the output instead.
        ConstraintError (llguidance's reason) if the parser refuses it: a token the mask did not allow, or the
        grammar past one of the parser's limits."""
        if not self.matcher.consume_token(int(token)):
            raise ConstraintError(f"the {self.constraint.kind} constraint failed at token {token} after {self.n_consumed} "
                                  f"tokens: {_one_line(self.matcher.get_error(), self.constraint.kind)}")
        self.n_consumed += 1


def version() -> dict[str, str]:
    """The constraint library's name and version (recorded in manifests' informative section)."""
    return {"llguidance": importlib.metadata.version("llguidance")}  # older releases have no __version__
