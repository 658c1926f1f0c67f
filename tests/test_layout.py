"""The package's layout follows the data path: model -> compute -> records -> api -> serve / integrations / bench ->
cli. A module imports only its own room or rooms below it, never one above, and the import graph has no cycle,
counting imports inside functions (read from the source with ``ast``, so a lazy import cannot hide a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "detinfer"
# Rank of each room; a module may import modules of a lower rank, or of its own room.
RANKS = {"base": 0, "model": 1, "compute": 2, "records": 3, "api": 4, "serve": 5, "integrations": 5, "bench": 5, "cli": 6}
BASE = {"errors", "paths", "fileio", "version"}
MAX_LINES = 600  # no module longer than this, but the kernels (one kernel per concept, each documented)
LONG_ALLOWED = {"compute.kernels"}


def modules() -> dict[str, Path]:
    """Dotted name below detinfer ("compute.engine", "" for the package itself) -> source file."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def room(name: str) -> str:
    if name == "":
        return "api"  # the package's __init__ re-exports the API
    head = name.split(".")[0]
    if head in BASE:
        return "base"
    return head


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The detinfer modules that ``name`` imports anywhere in its source (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "detinfer" or node.module.startswith("detinfer.")):
                target = node.module.removeprefix("detinfer").lstrip(".")
            else:
                continue
            for alias in node.names:  # from PKG import submodule
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "detinfer" or alias.name.startswith("detinfer."):
                    found.add(alias.name.removeprefix("detinfer").lstrip("."))
    return {m for m in found if m in known and m != name}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({room(a)}) imports {b} ({room(b)})" for a, targets in sorted(graph.items()) for b in sorted(targets)
            if room(a) != room(b) and RANKS[room(b)] >= RANKS[room(a)]]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_module_imports_a_room_above_its_own(graph):
    upward = upward_imports(graph)
    assert not upward, "imports against the data path:\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(m or "detinfer" for m in cycle or [])


def test_the_cli_goes_through_the_library_api(graph):
    """The CLI is a thin shell: it calls detinfer.api (and the server, integrations and bench built on it), never the
    model, compute or records rooms below the API."""
    below = [f"{a} imports {b}" for a, targets in sorted(graph.items()) if room(a) == "cli" for b in sorted(targets)
             if room(b) in ("model", "compute", "records")]
    assert not below, "\n".join(below)
    assert "api" in {room(b) for b in graph["cli.run"]}  # control: the check sees the CLI's imports


def test_modules_stay_short():
    long = {name: n for name, path in modules().items() if name not in LONG_ALLOWED
            and (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_negative_controls_are_detected(graph):
    """The checks fail on graphs that break them: an upward import, a cycle through a function-level import."""
    assert upward_imports({"model.chat": {"records.run"}, "records.run": {"model.chat"}}) == [
        "model.chat (model) imports records.run (records)"]
    assert find_cycle({"records.run": {"records.verify"}, "records.verify": {"records.session"},
                       "records.session": {"records.run"}}) == ["records.run", "records.verify", "records.session", "records.run"]
    assert "compute.kernels" in graph["compute.engine"]  # the reader sees real imports (a relative one here)
