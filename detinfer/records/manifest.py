"""Run manifests: everything an output depends on, hashed, in canonical JSON.

"Contract" fields (model, tokenizer, template, prompt, sampling, engine settings, outputs) are what a
re-execution must reproduce. "Informative" fields (threads, chunk size, timings, CPU, versions) are recorded
and shown but never compared. ``section_sha256`` holds one hash per contract section, so an edited manifest
is caught and the edited section named.

Schema 2 added ``chat_template``: which template a chat prompt was rendered with when it was not the model's own
(a jinja file or a built-in format), with its text, so ``run --manifest`` and ``verify`` render it again without
the file. It is a contract section only when present, so schema-1 manifests load and verify unchanged.

Schema 3 added ``constraint`` (constrain.Constraint: kind, full text, sha256), a contract section when present, and
``output.mask_digests`` (the chain of each step's allowed-token mask), written only for a constrained run; schema-1
and -2 manifests have neither and load and verify unchanged.
``numerics`` names the arithmetic that computed the outputs (detinfer/numerics.py); a manifest without it was
recorded with ``detinfer-numerics/1``. It is a contract section when present, and verify names a manifest of
another numerics as such. ``informative.machine`` records the machine (detinfer/machine.py), never compared.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from ..compute.constrain import Constraint
from ..compute.kvcache import KV_QUANT_REASON, QUANTIZED_KV_TYPES
from ..compute.numerics import NUMERICS_1
from ..compute.sampling import Sampling, missing_fields
from ..errors import KVTypeError, ManifestError, first_error, json_kind
from ..fileio import atomic_write_text, read_json

SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)  # 1: before ``chat_template``; 2: before ``constraint``; same fields otherwise


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # token ids in records: never negative, always an int32
Count = Annotated[int, Field(ge=0, lt=2**31)]  # positions, token counts


class OmitNone(BaseModel):
    """Leaves the fields named in OMIT_NONE out of its JSON when they are None, so a record without them serializes
    (and hashes) exactly as before they existed."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        data = handler(self)
        for key in self.OMIT_NONE:
            if data.get(key, 0) is None:
                del data[key]
        return data


def tokens_sha256(tokens: list[int]) -> str:
    """sha256 of token ids as comma-separated decimal text (e.g. "504,3575,282")."""
    return hashlib.sha256(",".join(str(t) for t in tokens).encode()).hexdigest()


class Message(_Record):
    role: str
    content: str


class ModelRecord(_Record):
    file_name: str
    registry_name: str | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    architecture: str
    tensor_types: dict[str, int]


class PromptRecord(_Record):
    text: str | None = None
    messages: list[Message] | None = None
    chat: bool
    rendered: str
    token_ids: list[TokenId]
    tokens_sha256: str


class ChatTemplateRecord(_Record):
    """A chat template that did not come from the model file: where from, its sha256 and its full text."""

    origin: Literal["file", "builtin"]
    name: str  # built-in format name, or the file's name (informative: the text is what counts)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    source: str


class EngineRecord(_Record):
    n_ctx: Count
    kv_type: Literal["f32", "f16"]


class OutputRecord(OmitNone, _Record):
    token_ids: list[TokenId]
    text: str
    stop_reason: Literal["eos", "stop", "stop_cut", "max_tokens", "length"]
    tokens_sha256: str
    kv_sha256: str
    logits_digests: list[str]
    top_logits: list[list[tuple[TokenId, float]]]
    mask_digests: list[str] | None = None  # constrained runs only (constrain.mask_digest chain)

    OMIT_NONE = ("mask_digests",)


class Informative(_Record):
    threads: int
    chunk_size: int
    timings: dict[str, float]
    cpu: str
    versions: dict[str, str]
    model_path: str
    machine: dict[str, str] = {}  # detinfer.machine.machine(); empty in files recorded before it existed


CONTRACT_FIELDS = ("model", "tokenizer_sha256", "chat_template_sha256", "prompt", "sampling", "engine", "output")
OPTIONAL_CONTRACT_FIELDS = ("chat_template", "constraint", "numerics")  # contract sections when present (not None)


class RunManifest(_Record):
    """A recorded run. Load with :func:`load_manifest`, write with :func:`write_manifest`."""

    schema_version: Literal[1, 2, 3] = SCHEMA_VERSION
    model: ModelRecord
    tokenizer_sha256: str
    chat_template_sha256: str | None
    chat_template: ChatTemplateRecord | None = None
    constraint: Constraint | None = None
    numerics: str | None = None  # None: detinfer-numerics/1 (see recorded_numerics)
    prompt: PromptRecord
    sampling: Sampling
    engine: EngineRecord
    output: OutputRecord
    section_sha256: dict[str, str] = {}
    informative: Informative

    def contract_fields(self) -> tuple[str, ...]:
        """CONTRACT_FIELDS plus the optional ones this manifest has."""
        return CONTRACT_FIELDS + tuple(k for k in OPTIONAL_CONTRACT_FIELDS if getattr(self, k) is not None)

    def recorded_numerics(self) -> str:
        """The numerics this manifest was recorded with (``detinfer-numerics/1`` when the field is absent)."""
        return self.numerics or NUMERICS_1

    def contract(self) -> dict[str, Any]:
        """The fields a re-execution must reproduce, as JSON-able data."""
        return self.model_dump(mode="json", include=set(self.contract_fields()))

    def compute_section_sha256(self) -> dict[str, str]:
        """sha256 of the canonical JSON of each contract section."""
        contract = self.contract()
        return section_hashes({k: contract[k] for k in self.contract_fields()})

    def sealed(self) -> "RunManifest":
        """This manifest with ``section_sha256`` filled in."""
        return self.model_copy(update={"section_sha256": self.compute_section_sha256()})

    def save(self, path: str | Path) -> None:
        """Write this manifest to ``path`` (sealed, canonical JSON, atomically): :func:`write_manifest`."""
        write_manifest(self, path)


def canonical_json(data: Any) -> str:
    """Sorted keys, 2-space indent, UTF-8 (not ASCII-escaped), trailing newline: one byte form per content."""
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def section_hashes(sections: dict[str, Any]) -> dict[str, str]:
    """sha256 hex of each section's canonical JSON: what a record's ``section_sha256`` holds."""
    return {k: hashlib.sha256(canonical_json(v).encode("utf-8")).hexdigest() for k, v in sections.items()}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_manifest(manifest: RunManifest, path: str | Path) -> None:
    """Seal and write ``manifest`` atomically as canonical JSON."""
    atomic_write_text(path, canonical_json(manifest.sealed().model_dump(mode="json")))


def load_manifest(path: str | Path) -> RunManifest:
    """Read and check a manifest (:func:`parse_manifest`); ManifestError (one line) if it is unreadable or not JSON."""
    return parse_manifest(read_json(Path(path), ManifestError, "manifest"), Path(path))


def parse_manifest(data: Any, path: Path) -> RunManifest:
    """Check the parsed JSON ``data`` of the manifest file ``path``.

    Raises ManifestError (one line) if it is from another schema version, schema-invalid, or edited after it was
    written (naming the section whose hash no longer matches).
    """
    if not isinstance(data, dict):
        raise ManifestError(f"{path} is not a manifest: the top level must be a JSON object, got {json_kind(data)}")
    version = data.get("schema_version")
    if "schema_version" not in data:
        raise ManifestError(f"{path} has no schema_version: it is not a detinfer run manifest")
    if version not in READABLE_SCHEMAS:
        raise ManifestError(
            f"{path} has schema_version {version!r}; this detinfer (schema {SCHEMA_VERSION}) cannot read it"
            + ("; upgrade detinfer" if isinstance(version, int) and version > SCHEMA_VERSION else "")
        )
    if missing := missing_fields(data.get("sampling")):  # a record states every option: no default fills a gap
        raise ManifestError(f"{path} is not a valid manifest: sampling.{missing[0]}: Field required")
    kv_type = (data.get("engine") or {}).get("kv_type") if isinstance(data.get("engine"), dict) else None
    if kv_type in QUANTIZED_KV_TYPES:
        raise KVTypeError(f"{path} is not a valid manifest: engine.kv_type {kv_type!r} is rejected: {KV_QUANT_REASON}")
    try:
        manifest = RunManifest.model_validate(data)
    except ValidationError as e:
        raise ManifestError(f"{path} is not a valid manifest: {first_error(e)} ({e.error_count()} error(s))") from None
    for section in (manifest.prompt, manifest.output):
        if tokens_sha256(section.token_ids) != section.tokens_sha256:
            name = "prompt" if section is manifest.prompt else "output"
            raise ManifestError(f"{path}: {name}.token_ids do not match {name}.tokens_sha256; the manifest was edited")
    if manifest.constraint is not None:
        manifest.constraint.check_sha256()
    expected = manifest.compute_section_sha256()
    edited = [k for k in manifest.contract_fields() if manifest.section_sha256.get(k) != expected[k]]
    edited += [k for k in OPTIONAL_CONTRACT_FIELDS if k in manifest.section_sha256 and k not in expected]  # removed
    if edited:
        raise ManifestError(f"{path}: section(s) {', '.join(edited)} no longer match their sha256; the manifest was edited")
    return manifest
