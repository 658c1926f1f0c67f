"""verify's results for CI systems: a JUnit XML file (one test case per file verified) and GitHub Actions
annotation lines (``::error file=...::...``), both carrying the divergence report of :meth:`Outcome.report`."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from typing import Sequence

from ..fileio import atomic_write_text
from ..records.outcome import BAD_INPUT, MISMATCH, Outcome


def junit_xml(results: Sequence[Outcome], *, suite: str = "detinfer verify") -> str:
    """JUnit XML: a testsuite with one testcase per result (name: the file's path, time: seconds); a mismatch is a
    ``<failure>``, bad input an ``<error>``, each with the first report line as message and the report as text."""
    root = ET.Element("testsuites")
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(results)),
                       failures=str(sum(r.status == MISMATCH for r in results)),
                       errors=str(sum(r.status == BAD_INPUT for r in results)),
                       time=f"{sum(r.seconds for r in results):.3f}")  # fmt: skip
    for r in results:
        case = ET.SubElement(ts, "testcase", classname="detinfer.verify", name=r.path, time=f"{r.seconds:.3f}")
        if r.status in (MISMATCH, BAD_INPUT):
            lines = r.report()
            el = ET.SubElement(case, "failure" if r.status == MISMATCH else "error", message=lines[0], type=r.status)
            el.text = "\n".join(lines)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(results: Sequence[Outcome], path: str | os.PathLike) -> None:
    """Write :func:`junit_xml` to ``path`` atomically."""
    atomic_write_text(path, junit_xml(results))


def _escape(text: str, *, prop: bool = False) -> str:
    """GitHub workflow-command escaping: %, CR, LF always; ':' and ',' too inside a property."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def github_annotations(results: Sequence[Outcome]) -> list[str]:
    """One ``::error`` workflow command per mismatching or bad file, titled by its status, with the report as
    its (multi-line) message; GitHub shows it on the file in the run's summary and the pull request."""
    return [f"::error file={_escape(r.path, prop=True)},title={_escape('detinfer verify: ' + r.status, prop=True)}::"
            f"{_escape(chr(10).join(r.report()))}" for r in results if r.status in (MISMATCH, BAD_INPUT)]


def cache_target() -> str:
    """The compile target as the JIT cache keys it: ``DETINFER_CPU_LEVEL`` when set (e.g. ``x86-64-v3``: any CPU
    of that level loads the kernels), else this CPU's instruction-set level (x86-64-v1..v4; on other
    architectures the LLVM target triple's) and LLVM's host CPU name, e.g. ``x86-64-v3-znver3``: numba keys
    compiled code on the CPU name and features, so a cache restored on another CPU would only be recompiled over.
    Raises InputError for a DETINFER_CPU_LEVEL that cannot be used here (compute.jit.cpu_level)."""
    import llvmlite.binding as ll

    from ..compute.jit import cpu_level as chosen
    from ..compute.jit import host_level

    return chosen() or f"{host_level()}-{ll.get_host_cpu_name()}"


def cache_key(model: str | os.PathLike | None = None) -> str:
    """The CI cache key of a model and its compiled kernels: detinfer, numba and Python versions (numba's cache
    entries hold code for one Python), the sealed entries' format (compute/jit_cache.py), the model's sha256 and
    :func:`cache_target`.

    ``model``: a registry name (default the registry's default model; its sha256 comes from the registry, so the
    key is known before the model is pulled) or a .gguf path (hashed). Raises GGUFError for a path that does not
    exist or is not a GGUF file, naming the registry models.
    """
    import platform

    import numba

    from ..compute import jit_cache
    from ..model.gguf_file import ModelFile
    from ..model.registry import DEFAULT_MODEL, REGISTRY, resolve_model
    from ..version import __version__

    model = DEFAULT_MODEL if model is None else model
    sha256 = REGISTRY[model].sha256 if model in REGISTRY else ModelFile(resolve_model(model)).sha256
    versions = f"detinfer-{__version__}-numba-{numba.__version__}-py{platform.python_version()}-jit{jit_cache.FORMAT}"
    return f"{versions}-{sha256[:16]}-{cache_target()}"
