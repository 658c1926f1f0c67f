"""The one record reader: a file is read and parsed once, and its kind decided from those bytes.

Kinds: a run manifest (``detinfer run --out``: ``schema_version``, no ``turns``), a golden record or pytest
snapshot of a run (``output_token_ids``), a session record (``session run --out``, ``serve --record``:
``schema_version`` and ``turns``) and a session snapshot (the pytest plugin's token stream of a session: ``turns``
without a schema version). Every check a kind has (schema, hashes, values) runs here, before anything executes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from pydantic import ValidationError

from ..compute.constrain import Constraint
from ..compute.kvcache import parse_kv_type
from ..compute.sampling import Sampling, missing_fields
from ..errors import InputError, ManifestError, first_error, json_kind
from ..fileio import read_json
from .kvfile import MAGIC as KV_MAGIC
from .manifest import EngineRecord, RunManifest, parse_manifest
from .session import SessionRecord, parse_session
from .tokenstream import RunStream, SessionStream

KINDS = ("manifest", "golden", "session", "session-snapshot")


@dataclass(frozen=True)
class GoldenSettings:
    """What a golden record's ``settings`` hold: the engine's n_ctx and kv_type, whether the prompt was a chat, the
    sampling and the constraint."""

    n_ctx: int
    kv_type: str
    chat: bool
    sampling: Sampling
    constraint: Constraint | None


@dataclass(frozen=True)
class Record:
    """A recorded file, parsed and checked: ``body`` is a RunManifest (kind manifest), a RunStream (golden), a
    SessionRecord (session) or a SessionStream (session-snapshot); ``golden``: the parsed settings of a golden record.
    ``model_sha256`` / ``n_ctx`` / ``kv_type``: what re-executing it needs; ``model_names``: where the record says
    its model is (a registry name, a path), in the order to try them."""

    path: Path
    kind: str
    body: RunManifest | RunStream | SessionRecord | SessionStream
    golden: GoldenSettings | None = None

    @property
    def model_sha256(self) -> str:
        b = self.body
        return b.model.sha256 if isinstance(b, (RunManifest, SessionRecord)) else b.model_sha256

    @property
    def n_ctx(self) -> int:
        return int(self._engine_setting("n_ctx"))

    @property
    def kv_type(self) -> str:
        return str(self._engine_setting("kv_type"))

    def _engine_setting(self, key: str) -> Any:
        """An engine setting the record was computed with: its engine section, else its (checked) settings."""
        b = self.body
        if isinstance(b, (RunManifest, SessionRecord)):
            return getattr(b.engine, key)
        return getattr(self.golden, key) if self.golden is not None else b.settings[key]

    @property
    def model_names(self) -> list[str]:
        b = self.body
        if isinstance(b, RunManifest):
            return [n for n in (b.model.registry_name, b.informative.model_path) if n]
        if isinstance(b, SessionRecord):
            return [n for n in (b.model.registry_name, b.informative.get("model_path")) if n]
        return []


def collect(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Record files from files and folders (folders: every *.json below them, sorted). ManifestError for a path that
    does not exist (a file that is not regular is kept, and reported as bad input when read)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*.json") if q.is_file()))
        elif os.path.lexists(p):
            files.append(p)
        else:
            raise ManifestError(f"{p} does not exist; pass manifest files or folders")
    return files


def collect_sessions(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """``replay``'s files: session files, or folders of them (a folder: its *.json, sorted, not below it). InputError
    for a missing path or one that is not a regular file or folder, or no files at all."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.glob("*.json")))
        elif p.is_file():
            files.append(p)
        elif p.exists():
            raise InputError(f"{p} is not a regular file; pass session files or folders")
        else:
            raise InputError(f"{p} does not exist; pass session files or folders")
    if not files:
        raise InputError(f"no session files (*.json) in {', '.join(map(str, paths))}")
    return files


def _is_script(data: dict) -> bool:
    """A session script's shape: turns of messages, and none of what a record of a run has."""
    turns = data.get("turns")
    return (isinstance(turns, list) and bool(turns) and isinstance(turns[0], dict) and "messages" in turns[0]
            and not {"schema_version", "model_sha256"} & data.keys())  # fmt: skip


def read_record(path: str | os.PathLike, what: str = "record") -> Record:
    """Read, parse and check one record; ManifestError (one line, naming the file as ``what``) if it is unreadable,
    no kind of record, or invalid."""
    path = Path(path)
    try:
        data = read_json(path, ManifestError, what)
    except ManifestError:
        if path.is_file():  # a regular file (a FIFO is never opened twice)
            with open(path, "rb") as f:
                if f.read(len(KV_MAGIC)) == KV_MAGIC:
                    raise ManifestError(f"{path} is a KV cache snapshot (.detkv), not a {what}: inspect it with "
                                        "detinfer kv inspect") from None  # fmt: skip
        raise
    return parse_record(data, path, what)


def parse_record(data: Any, path: Path, what: str = "record") -> Record:
    """:func:`read_record` of ``data``, the JSON already parsed (with :func:`~detinfer.fileio.parse_json`) from ``path``."""
    if not isinstance(data, dict):
        raise ManifestError(f"{path} is not a {what}: the top level must be a JSON object, got {json_kind(data)}")
    if _is_script(data):
        raise ManifestError(f"{path} is a session script (turns to run), not a record of a run: run it with "
                            f"`detinfer session run {path} --out session.json`, then re-execute the record it writes")  # fmt: skip
    if "turns" in data and "schema_version" in data:
        return Record(path, "session", parse_session(data, path))
    if "turns" in data:
        stream = _validated(SessionStream, data, path, "session snapshot")
        for key in ("n_ctx", "kv_type"):
            if key not in stream.settings:
                raise ManifestError(f"{path} is not a valid session snapshot: settings.{key} is missing")
        EngineRecord(n_ctx=stream.settings["n_ctx"], kv_type=parse_kv_type(stream.settings["kv_type"]))
        return Record(path, "session-snapshot", stream)
    if "output_token_ids" in data and "schema_version" not in data:
        stream = _validated(RunStream, data, path, "golden record")
        return Record(path, "golden", stream, golden_settings(path, stream))
    if "schema_version" not in data:
        raise ManifestError(f"{path} is not a {what}: it has none of the keys of a run manifest (schema_version), a golden "
                            "stream (output_token_ids) or a session (turns)")  # fmt: skip
    return Record(path, "manifest", parse_manifest(data, path))


def _validated(model: type, data: dict, path: Path, what: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ManifestError(f"{path} is not a valid {what}: {first_error(e)}") from None


def golden_settings(path: Path, record: RunStream) -> GoldenSettings:
    """A golden record's settings, checked; ManifestError naming a missing or bad key."""
    settings = dict(record.settings)
    try:
        n_ctx, kv_type, chat = settings.pop("n_ctx"), settings.pop("kv_type"), settings.pop("chat")
        EngineRecord(n_ctx=n_ctx, kv_type=parse_kv_type(kv_type))  # a quantized KV type is rejected with its reason
        constraint = Constraint.model_validate(settings.pop("constraint")) if "constraint" in settings else None
        if missing := missing_fields(settings):  # a record states every option
            raise KeyError(missing[0])
        sampling = Sampling.model_validate(settings)
    except KeyError as e:
        raise ManifestError(f"{path} is not a valid golden record: settings.{e.args[0]} is missing") from None
    except ValidationError as e:
        raise ManifestError(f"{path} is not a valid golden record: {first_error(e, 'settings.')}") from None
    if not isinstance(chat, bool):
        raise ManifestError(f"{path} is not a valid golden record: settings.chat must be true or false, got {chat!r}")
    if constraint is not None:
        constraint.check_sha256()
    return GoldenSettings(n_ctx, kv_type, chat, sampling, constraint)
