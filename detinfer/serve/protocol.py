"""The OpenAI protocol as detinfer serves it: request models (pydantic, ``extra="forbid"``: every unknown or
unsupported parameter is a 400 naming it, never silently ignored), the error shape, and the bounded body reader.

Chat completions and completions share :class:`SamplingFields`; the Responses API has its own request
(:class:`ResponsesRequest`) that serve/responses.py turns into a chat request. Ranges are OpenAI's where it has
them; ``seed`` is the sampler's (0 <= seed < 2**64). Besides OpenAI's parameters, llama.cpp server's sampling
extensions (``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``ignore_eos``) mean what they mean to
``detinfer run``.

Leniency is OpenAI's: inside messages, the helper fields the official SDKs add to a reply they parsed or streamed
(:data:`SDK_MESSAGE_FIELDS`) are accepted and ignored (never rendered or recorded), so a client can send a reply
back as it got it; an unknown top-level parameter stays a 400.
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from ..compute.constrain import TOOL_NAME, Constraint
from ..compute.sampling import Sampling
from ..errors import ConstraintError, json_kind
from ..fileio import parse_json
from ..model.tool_parsers import ToolCallFormat
from .schemas import json_object_constraint, schema_constraint, tool_call_constraint

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 30.0
MAX_STOP = 4  # OpenAI's limit on stop sequences
# What the official SDKs (openai-python, openai-node) add inside a message they parsed or streamed: a message's
# ``parsed`` (parse() / stream() with a response format), a tool call's ``index`` (kept from the stream's deltas by
# openai-python's stream helpers) and its function's ``parsed_arguments`` (parse() / stream() / runTools() with
# strict or parseable tools). Accepted and ignored. (OpenAI's reply fields ``refusal``, ``annotations``, ``audio``
# and ``function_call`` are accepted as well, see Message.)
SDK_MESSAGE_FIELDS = ("messages.N.parsed", "messages.N.tool_calls.M.index", "messages.N.tool_calls.M.function.parsed_arguments")
# Other servers' spellings of a parameter, for the 400 that names detinfer's
_WIRE_SPELLINGS = {"repetition_penalty": "repeat_penalty", "max_new_tokens": "max_tokens", "n_predict": "max_tokens"}


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = status, message, param, code, type_, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# pydantic's name for one member of a union in an error's location ("str", "list[dict[str,any]]", "NamedToolChoice"):
# not a parameter of the request, so never part of the ``param`` a client sees
_UNION_MEMBER = re.compile(r"(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*)", re.S)
# what a value of the wrong type was expected to be, per pydantic error type
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object", "none_required": "null"}  # fmt: skip


def _wire_loc(loc: tuple) -> tuple:
    return tuple(x for x in loc if not (isinstance(x, str) and _UNION_MEMBER.fullmatch(x)))


def validation_error(e: ValidationError) -> ApiError:
    """The 400 of a request that does not validate, naming its parameter as the client spelled it. A value that no
    member of a union accepts is reported once: the deepest error of those under the first error's parameter (a
    field missing inside an object), or, when every member refused its type, what it should have been ("expected a
    string or an array, got a number")."""
    errors = [(err, _wire_loc(err["loc"])) for err in e.errors()]
    first = errors[0][1]
    err, loc = max((x for x in errors if x[1][: len(first)] == first), key=lambda x: len(x[1]))
    same = [x for x, at in errors if at == loc]
    param = ".".join(str(x) for x in loc) or None
    if err["type"] == "extra_forbidden":
        name = str(err["loc"][-1])
        hint = f" (this server spells it {_WIRE_SPELLINGS[name]})" if name in _WIRE_SPELLINGS else ""
        return ApiError(400, f"Unrecognized or unsupported request argument supplied: {param}{hint}", param=param,
                        code="unsupported_parameter")  # fmt: skip
    if len(same) > 1 and all(x["type"] in _EXPECTED or x["type"] == "literal_error" for x in same):
        kinds = list(dict.fromkeys(_EXPECTED.get(x["type"]) or x["ctx"]["expected"] for x in same))  # list[str] | list[int]
        last = ", or " if any(" or " in k for k in kinds) else " or "  # a literal's "'a', 'b' or 'c'" comes whole
        expected = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + last + kinds[-1]
        return ApiError(400, f"Invalid type for {param}: expected {expected}, got {json_kind(err['input'])}", param=param,
                        code="invalid_type")  # fmt: skip
    return ApiError(400, f"Invalid value for {param}: {err['msg']}", param=param, code="invalid_value")


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(_Req):
    name: str
    arguments: str
    parsed_arguments: Any = None  # an SDK's helper field (SDK_MESSAGE_FIELDS): ignored


class ToolCall(_Req):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # an SDK's helper field (SDK_MESSAGE_FIELDS): ignored

    def template_dict(self) -> dict[str, Any]:
        """The call as OpenAI defines it (helper fields dropped): {"id", "type", "function": {"name", "arguments"}}."""
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": self.function.arguments}}


class Message(_Req):
    """A chat message as OpenAI clients send it; ``developer`` is rendered as ``system``. Content parts other than
    text (images, audio, files) cannot be honoured and are a 400 naming the part."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: None = None  # deprecated by OpenAI; clients echo it as null
    audio: None = None
    annotations: list[dict[str, Any]] | None = None  # citations of an earlier reply (output metadata, not rendered)
    parsed: Any = None  # an SDK's helper field (SDK_MESSAGE_FIELDS): ignored

    def text(self, param: str) -> str | None:
        """The content as one string (text parts joined); ApiError naming ``param`` for a non-text part."""
        if not isinstance(self.content, list):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{param}.{j}: only text content parts are supported, got type {part.get('type')!r}",
                               param=f"{param}.{j}", code="unsupported_value")  # fmt: skip
            texts.append(part["text"])
        return "".join(texts)

    def template_dict(self, i: int) -> dict[str, Any]:
        """The message as a chat template sees it (HF style: tool call arguments as objects when they parse as one)."""
        content = self.text(f"messages.{i}.content")
        if content is None:
            content = self.refusal
        if content is None and not self.tool_calls:
            raise ApiError(400, f"messages.{i}.content is required", param=f"messages.{i}.content", code="missing_required_parameter")
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg


class StreamOptions(_Req):
    include_usage: bool = False


class JsonSchemaFormat(_Req):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # true: every object schema without additionalProperties is closed (schemas.closed)


class ResponseFormat(_Req):
    """``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {...}}``;
    enforced as schemas.py describes (compact JSON; closed objects when ``strict``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json_object_constraint()
        if self.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs a json_schema object", param="response_format.json_schema",
                           code="missing_required_parameter")
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return schema_constraint(schema, strict=bool(self.json_schema.strict))


class FunctionName(_Req):
    name: str


class NamedToolChoice(_Req):
    type: Literal["function"]
    function: FunctionName


class SamplingExtensions(_Req):
    """llama.cpp server's sampling extensions, with detinfer run's meaning (Sampling; wire names in SAMPLING_EXTENSIONS)."""

    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None  # Sampling.repetition_penalty
    repeat_last_n: int | None = None
    ignore_eos: bool | None = None


class SamplingFields(SamplingExtensions):
    """Parameters shared by both endpoints. Ranges are OpenAI's; seed is the sampler's (0 <= seed < 2**64); the
    llama.cpp extensions are checked by :class:`Sampling` (its ranges, named by their wire names)."""

    model: str  # one of the server's names (Server.names), else a 404; never resolved as a path
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def check(self) -> None:
        """Reject what the engine cannot do exactly, naming the parameter (never silently ignored)."""
        if self.n not in (None, 1):
            raise ApiError(400, f"n={self.n} is not supported; only n=1", param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not implemented; only 0 is accepted", param=name, code="unsupported_value")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ApiError(400, f"stop: at most {MAX_STOP} sequences, got {len(self.stop)}", param="stop", code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")

    def sampling(self, max_tokens: int) -> Sampling:
        """The one mapping from OpenAI's fields (and llama.cpp's extensions) onto detinfer's :class:`Sampling`, with
        OpenAI's defaults (temperature 1, top_p 1) and ``detinfer run``'s for the extensions; ``seed`` defaults to 0
        (OpenAI has none). ``max_tokens``: the endpoint's limit. ApiError 400 naming the wire parameter if a value is
        out of Sampling's range."""
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        extensions = {field: getattr(self, wire) for wire, field in SAMPLING_EXTENSIONS.items() if getattr(self, wire) is not None}
        try:
            return Sampling(temperature=1.0 if self.temperature is None else float(self.temperature),
                            top_p=1.0 if self.top_p is None else float(self.top_p), seed=self.seed or 0,
                            max_tokens=max_tokens, stop=stop, **extensions)  # fmt: skip
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "?"
            param = {f: w for w, f in SAMPLING_EXTENSIONS.items()}.get(field, field)
            raise ApiError(400, f"Invalid value for {param}: {err['msg']}", param=param, code="invalid_value") from None


# wire name -> Sampling field of the llama.cpp server extensions
SAMPLING_EXTENSIONS = {"top_k": "top_k", "min_p": "min_p", "repeat_penalty": "repetition_penalty",
                       "repeat_last_n": "repeat_last_n", "ignore_eos": "ignore_eos"}  # fmt: skip


ToolName = Annotated[str, Field(pattern=f"^{TOOL_NAME.pattern}$")]  # so no tool name can hold call markup


class FunctionDef(_Req):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Req):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # required / named: a constraint
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value")

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def constraint(self, fmt: ToolCallFormat | None) -> Constraint | None:
        """The constraint this request asks for (as enforced, see schemas.py): one tool call in the template's call
        format ``fmt`` for tool_choice required / named, else the response_format's; ApiError 400 naming the
        parameter if it is invalid."""
        param = "tool_choice" if self.forces_tool_call else "response_format"
        try:
            if self.forces_tool_call:
                if not self.tools:
                    raise ConstraintError(f"tool_choice {self.tool_choice!r} needs tools")
                name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
                return tool_call_constraint([t.function.model_dump(exclude_none=True) for t in self.tools], name, fmt)
            return self.response_format.constraint() if self.response_format is not None else None
        except ConstraintError as e:
            raise ApiError(400, str(e), param=param, code="invalid_value") from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        for name, ok in (("echo", not self.echo), ("suffix", self.suffix is None),
                         ("best_of", self.best_of in (None, 1))):  # fmt: skip
            if not ok:
                raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ApiError(400, "prompt: only one prompt per request", param="prompt", code="unsupported_value")

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs


class FunctionTool(_Req):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Req):
    """Responses' ``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "name", "schema", "strict", "description"}`` (flat, unlike chat's response_format), enforced as chat's."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """The equivalent chat ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.name is None:
            raise ApiError(400, "text.format of type json_schema needs a name", param="text.format.name", code="invalid_value")
        fields = {"name": self.name, "description": self.description, "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in fields.items() if v is not None}}


class TextOptions(_Req):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class NamedFunction(_Req):
    """The Responses API's named tool choice (flat, unlike chat completions' ``{"function": {"name"}}``)."""

    type: Literal["function"]
    name: str


class ResponsesRequest(SamplingExtensions):
    """The Responses parameters detinfer honours; any other is a 400 naming it (never silently ignored)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = False
    store: bool | None = None  # responses are kept in memory either way (for previous_response_id)
    metadata: dict[str, str] | None = None
    include: list[str] | None = Field(None, max_length=0)  # nothing extra can be included
    truncation: Literal["disabled"] | None = None
    text: TextOptions | None = None
    user: str | None = None


async def read_json(request: Request, limit: int, timeout: float = BODY_TIMEOUT_S) -> dict:
    """The request body as a JSON object (bounded depth, valid UTF-8 strings: fileio.parse_json); 413 above
    ``limit`` bytes (the rest is drained, not kept), 408 if it takes longer than ``timeout`` seconds to arrive."""
    size, body = 0, bytearray()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > 64 * limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}", code="body_too_large")
    try:
        async with asyncio.timeout(timeout):
            async for part in request.stream():
                size += len(part)
                if size <= limit:
                    body += part
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected while sending the body", code="client_disconnected") from None
    if size > limit:
        raise ApiError(413, f"request body of {size} bytes exceeds the limit of {limit}", code="body_too_large")
    data = parse_json(bytes(body), lambda msg: ApiError(400, msg, code="invalid_json"), "request body")
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


def parse(model: type[_Req], data: dict) -> Any:
    """``data`` validated as ``model`` (a 400 naming the first bad parameter), then its own checks."""
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    if hasattr(req, "check"):
        req.check()
    return req
