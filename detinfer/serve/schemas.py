"""JSON Schemas as the server enforces them: the size cap on what the client sent, OpenAI's strict mode (every
object closed), compact JSON whitespace, the grammar of a forced tool call, and the validation of a strict tool's
generated arguments with bounded work.

- **The cap** (``MAX_CONSTRAINT_BYTES``, 64 KiB) applies to the schema as the request holds it, measured as its
  compact JSON (separators ``,`` and ``:``, non-ASCII characters as UTF-8): ``response_format``'s
  ``json_schema.schema``, the ``text.format`` schema of a Responses request, a strict tool's ``parameters``, or for a
  forced call the list of the ``parameters`` of the tools it may call. What is enforced (closed, with llguidance's
  options, inside the call's markup) is somewhat bigger and is recorded as enforced.
- **Strict** (``strict: true`` on a json_schema format or a tool): every object schema without
  ``additionalProperties`` gets ``"additionalProperties": false``, as OpenAI's strict mode treats it.
- **Whitespace**: every JSON grammar is compact (llguidance's ``"x-guidance": {"whitespace_flexible": false}``), unless
  the schema has its own top-level ``x-guidance`` (llguidance's JSON options), which is kept as written; for a forced
  call, that of the called tool's ``parameters`` when the request names the tool.
- **Validation** of a strict tool's arguments when the call was not forced (a forced call is already generated under
  the grammar): jsonschema's Draft 2020-12 validator with ``pattern`` and ``patternProperties`` run by RE2 (linear
  time in the text, no backtracking), no remote ``$ref`` retrieval, formats as annotations, and at most
  ``MAX_VALIDATION_CALLS`` Python calls (a deterministic work bound, not a clock: the same arguments get the same
  verdict on every machine). Arguments that fail, or whose validation cannot finish within the bound, are not a call.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import jsonschema
import re2
import referencing

from ..compute.constrain import MAX_CONSTRAINT_BYTES, Constraint, check_schema_object, text_sha256
from ..errors import ConstraintError
from ..model.tokenizer import Tokenizer
from ..model.tool_parsers import ToolCallFormat

COMPACT = {"whitespace_flexible": False}  # llguidance: no whitespace between JSON tokens
MAX_VALIDATION_CALLS = 200_000  # Python calls one validation may make (measured: a 30-key object takes ~600, the bound ~0.25 s)
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is reported to the client, not logged by RE2 on stderr

# keywords whose value is a schema, a list of schemas, or a map of names to schemas (Draft 2020-12 and 7)
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "not", "if",
        "then", "else", "contains", "propertyNames")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def check_cap(value: Any, what: str) -> None:
    """ConstraintError if ``value``'s compact JSON is over MAX_CONSTRAINT_BYTES of UTF-8."""
    size = len(compact_json(value).encode("utf-8"))
    if size > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(f"{what} is {size:,} bytes as compact JSON; the cap is {MAX_CONSTRAINT_BYTES:,} bytes (simplify it)")


def _map_subschemas(schema: dict, fn: Callable[[Any], Any]) -> dict:
    """A copy of ``schema`` with ``fn`` applied to each of its direct subschemas (values of data keywords such as
    ``const``, ``enum`` or ``default`` are never touched)."""
    out = {}
    for key, value in schema.items():
        if key in _ONE and isinstance(value, dict) or key == "items" and isinstance(value, list):
            value = fn(value) if isinstance(value, dict) else [fn(v) for v in value]
        elif key in _MANY and isinstance(value, list):
            value = [fn(v) for v in value]
        elif key in _MAP and isinstance(value, dict):
            value = {name: fn(v) for name, v in value.items()}
        out[key] = value
    return out


def _is_object_schema(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or isinstance(kind, list) and "object" in kind or "properties" in schema


def closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` in every object schema that does not say (strict mode)."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, closed)
    if _is_object_schema(schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def json_options(schema: dict, options: Any = None) -> dict:
    """``schema`` with llguidance's JSON options at its top level: its own ``x-guidance``, else ``options``, else compact."""
    if "x-guidance" in schema:
        return schema
    return {"x-guidance": options if options is not None else COMPACT, **schema}


def _enforced(kind: str, text: str) -> Constraint:
    # Built directly: the cap was applied to what the client sent (check_cap), not to this larger text.
    return Constraint(kind=kind, text=text, sha256=text_sha256(text))


def schema_constraint(schema: Any, *, strict: bool, what: str = "the JSON Schema") -> Constraint:
    """The json_schema constraint the server enforces for a response format's ``schema`` (closed when ``strict``,
    compact whitespace unless it says otherwise). ConstraintError for a schema that is not an object or over the cap."""
    check_schema_object(schema)
    check_cap(schema, what)
    return _enforced("json_schema", compact_json(json_options(closed(schema) if strict else schema)))


def json_object_constraint() -> Constraint:
    """``response_format`` json_object: any JSON object, in compact JSON."""
    return _enforced("json_schema", compact_json(json_options({"type": "object"})))


def tool_parameters(function: dict) -> dict:
    """A function tool's arguments schema as enforced: its ``parameters`` (any object if absent), closed if strict."""
    params = function.get("parameters") or {"type": "object"}
    return closed(params) if function.get("strict") else params


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with its local references (``#``, ``#/$defs/...``) pointing into it at JSON pointer ``base``
    (where it sits inside the call's schema), so its ``$defs`` still resolve."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, lambda sub: _rebased(sub, base))
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def tool_call_constraint(functions: list[dict], name: str | None, fmt: ToolCallFormat) -> Constraint:
    """Exactly one call in ``fmt``'s markup to one of ``functions`` (OpenAI function dicts: name, parameters,
    strict), or to ``name`` only: ``{"name": NAME, ARGUMENTS_KEY: {...}}`` with the arguments valid for that
    function's schema as enforced (:func:`tool_parameters`; its local ``$ref``s rebased). Kind lark (markup around a ``%json`` call) or
    json_schema (no markup). ConstraintError if ``name`` is not among the functions or the schemas are over the cap."""
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ConstraintError(f"tool_choice names function {name!r}, which is not among the tools")
    check_cap([f.get("parameters") for f in functions], "the parameters of the tools the call may use")
    key = fmt.arguments_key
    at = ["#/properties/" + key] if len(functions) == 1 else [f"#/anyOf/{i}/properties/{key}" for i in range(len(functions))]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: _rebased(tool_parameters(f), base)},
              "required": ["name", key], "additionalProperties": False} for f, base in zip(functions, at)]  # fmt: skip
    options = (functions[0].get("parameters") or {}).get("x-guidance") if name is not None else None
    schema = json_options(calls[0] if len(calls) == 1 else {"anyOf": calls}, options)
    if not fmt.prefix and not fmt.suffix:
        return _enforced("json_schema", compact_json(schema))
    literals = [json.dumps(text, ensure_ascii=False) for text in (fmt.prefix, fmt.suffix)]
    body = " ".join([literals[0]] * bool(fmt.prefix) + ["call"] + [literals[1]] * bool(fmt.suffix))
    return _enforced("lark", f"start: {body}\ncall: %json {compact_json(schema)}\n")


# --------------------------------------------------------------------------------------------- validation


class _OutOfWork(Exception):
    pass


def _subschemas(schema: Any):
    """``schema`` and every schema inside it."""
    stack = [schema]
    while stack:
        s = stack.pop()
        if not isinstance(s, dict):
            continue
        yield s
        for key, value in s.items():
            if key in _ONE:  # "items" among them, a schema or (Draft 7) a list of schemas
                stack.extend(value if isinstance(value, list) else [value])
            elif key in _MANY and isinstance(value, list):
                stack.extend(value)
            elif key in _MAP and isinstance(value, dict):
                stack.extend(value.values())


class ArgumentsValidator:
    """Validates a strict tool's generated arguments against its schema as enforced (see the module docstring).

    Construction compiles every ``pattern`` and ``patternProperties`` key with RE2 and the schema with llguidance
    against ``tokenizer`` (what a forced call would enforce), so an invalid or unsupported schema is a
    ConstraintError (one line) before any token.
    """

    def __init__(self, function: dict, tokenizer: Tokenizer):
        self.name = function["name"]
        params = function.get("parameters") or {"type": "object"}
        check_cap(params, f"the parameters of strict tool {self.name!r}")
        schema = tool_parameters(function)
        _enforced("json_schema", compact_json(json_options(schema))).check(tokenizer)
        self.patterns: dict[str, Any] = {}
        for s in _subschemas(schema):
            for pattern in [s.get("pattern")] + list(s.get("patternProperties") or {}):
                if isinstance(pattern, str) and pattern not in self.patterns:
                    try:
                        self.patterns[pattern] = re2.compile(pattern, _RE2_OPTIONS)
                    except re2.error as e:
                        msg = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
                        raise ConstraintError(f"pattern {pattern!r} is not supported (RE2 syntax, no lookaround or "
                                              f"backreferences): {msg}") from None  # fmt: skip
        cls = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                           {"pattern": self._pattern, "patternProperties": self._pattern_properties})  # fmt: skip
        self.validator = cls(schema, registry=referencing.Registry())  # an empty registry: no remote $ref is fetched

    def _pattern(self, validator, pattern, instance, schema):
        if validator.is_type(instance, "string") and not self.patterns[pattern].search(instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")

    def _pattern_properties(self, validator, pattern_properties, instance, schema):
        if validator.is_type(instance, "object"):
            for pattern, subschema in pattern_properties.items():
                for k, v in instance.items():
                    if self.patterns[pattern].search(k):
                        yield from validator.descend(v, subschema, path=k, schema_path=pattern)

    def is_valid(self, arguments: Any) -> bool:
        """Whether ``arguments`` (the parsed JSON) satisfy the schema; False too when the validation cannot finish
        within MAX_VALIDATION_CALLS Python calls or fails in any other way (a recursive ``$ref``, say)."""
        calls = 0

        def count(frame, event, arg):  # a 'call' event per Python function call (and generator resume)
            nonlocal calls
            calls += 1
            if calls > MAX_VALIDATION_CALLS:
                raise _OutOfWork
            return None  # no line events

        previous = sys.gettrace()
        sys.settrace(count)
        try:
            return self.validator.is_valid(arguments)
        except Exception:  # out of work, recursion, an unresolvable reference: not shown valid, so not a call
            return False
        finally:
            sys.settrace(previous)
