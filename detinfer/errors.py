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
