"""Typed errors. Only the CLI (and later the server) turns them into exit codes."""


class DetinferError(Exception):
    """Bad input or an unsupported request: the message is one line naming the problem and the fix.

    exit_code: 2 (bad input) unless a subclass says otherwise.
    """

    exit_code = 2


class GGUFError(DetinferError):
    """A GGUF file that is missing, truncated, malformed or uses something the engine does not support."""


class ConfigError(DetinferError):
    """Model metadata that is missing a key or names an unsupported architecture."""


class TokenizerError(DetinferError):
    """Tokenizer metadata the engine cannot build a tokenizer from, or text it cannot encode."""


class TemplateError(DetinferError):
    """A chat template that fails to render in the sandbox."""


class PullError(DetinferError):
    """A model download or extraction that failed, or whose sha256 does not match the registry."""


class InputError(DetinferError):
    """A prompt, option or parameter value that is invalid (empty prompt, too long, bad sampling value...)."""


class ConstraintError(InputError):
    """A constraint (JSON Schema, regex, Lark grammar) that is invalid, unsupported, too large or can never match."""


class KVTypeError(InputError):
    """A quantized KV cache type was requested: it breaks the determinism contract."""


class KVFileError(DetinferError):
    """A .detkv KV snapshot file that is missing, truncated, corrupt (checksum), of another format version, or
    made for another model, tokenizer, KV type or shape."""


class ManifestError(DetinferError):
    """A run manifest that is unreadable, schema-invalid, tampered with, or refers to another model."""


class MismatchError(DetinferError):
    """A re-execution whose outputs differ from the recorded ones."""

    exit_code = 1


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}  # fmt: skip


def json_kind(value: object) -> str:
    """What a parsed JSON value is, for messages: "an object", "an array", "a string", "a number", "a boolean", "null"."""
    return _JSON_KINDS.get(type(value), "something else")


def first_error(e: Exception, prefix: str = "") -> str:
    """The first error of a pydantic ValidationError ``e`` as one phrase, ``loc: msg`` with ``prefix`` before the
    location ("turns.0.messages: Field required"); a top level of the wrong kind, which has no location, says what
    it must be ("the top level must be a JSON object, got an array")."""
    err = e.errors()[0]  # type: ignore[attr-defined]
    loc = prefix + ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own ValueError
    if loc:
        return f"{loc}: {msg}"
    if err["type"] in ("model_type", "dict_type", "model_attributes_type"):
        return f"the top level must be a JSON object, got {json_kind(err['input'])}"
    return msg
