"""The house's import graph: no circle, and no arrow running back up.

Read from the source with :mod:`ast`, not by importing: every ``import`` counts, at
module level, inside a function (an import that runs late is still a dependency) or under
``if TYPE_CHECKING:`` (a type named in an annotation is a dependency of the reader's
understanding, and a circle through one is a circle still). ``from pkg import name`` is an arrow to
``pkg.name`` where that is a module, else to ``pkg`` itself (its ``__init__``). A module
loaded by name (``importlib.import_module``, a worker process started with ``-m``) draws no
arrow: that is how a plug-in or a process is reached without a dependency.

The floors, bottom up (docs/design.md, "Which way imports go"):

- ``chunkd.<module>`` (errors, ranges, memfd, snapshot, ...): the shared ground floor;
- ``chunkd.cache``: the ground floor only;
- ``chunkd.client``: the ground floor only (a trainer never loads the daemon);
- ``chunkd.gateway``: the ground floor, the cache, the client's protocol (and, inside
  ``gateway/cli/``, the client: those commands are clients);
- ``chunkd.testing``: anything of the package;
- ``bench``: anything; nothing in the package imports it.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
#: top-level folder -> the module prefix it installs as
FOLDERS = {
    "cache": "chunkd.cache",
    "gateway": "chunkd.gateway",
    "client": "chunkd.client",
    "testing": "chunkd.testing",
    "bench": "bench",
}


def _modules() -> dict[str, Path]:
    """Every module of the package and of bench/, by dotted name."""
    found: dict[str, Path] = {}
    for path in sorted((ROOT / "src" / "chunkd").glob("*.py")):
        name = "chunkd" if path.stem == "__init__" else f"chunkd.{path.stem}"
        found[name] = path
    for path in sorted((ROOT / "src" / "chunkd").glob("*/**/*.py")):
        if path.relative_to(ROOT / "src" / "chunkd").parts[0] in FOLDERS:
            continue  # the symlinks cache/ gateway/ client/ testing/: read from FOLDERS
        parts = path.relative_to(ROOT / "src").with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    for folder, prefix in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it stands."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is one of ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if _is_package(path) else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                found = _known(target, modules)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def _floor_problem(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target``, or None."""

    def within(name: str, room: str) -> bool:
        return name == room or name.startswith(room + ".")

    if within(target, "bench") and not within(source, "bench"):
        return "nothing in the package imports bench/"
    if within(source, "bench") or within(source, "chunkd.testing"):
        return None
    if source == "chunkd.__main__":
        return None  # ``python -m chunkd``: the command line's entry point
    if within(target, "chunkd.testing"):
        return "only the tests and the benchmarks import chunkd.testing"
    rooms = ("chunkd.cache", "chunkd.client", "chunkd.gateway")
    if not any(within(source, room) for room in rooms):
        if any(within(target, room) for room in rooms):
            return "the shared modules of src/chunkd/ import none of cache, client, gateway"
        return None
    if within(source, "chunkd.cache") and (
        within(target, "chunkd.client") or within(target, "chunkd.gateway")
    ):
        return "the cache is a library: it imports neither the client nor the daemon"
    if within(source, "chunkd.client") and (
        within(target, "chunkd.cache") or within(target, "chunkd.gateway")
    ):
        return "the client imports nothing of the daemon or the cache"
    if (
        within(source, "chunkd.gateway")
        and within(target, "chunkd.client")
        and not within(target, "chunkd.client.protocol")
        and not within(source, "chunkd.gateway.cli")
        and target != "chunkd.client"
    ):
        return "the daemon imports only the client's protocol (its commands are clients)"
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph(_modules())


def test_the_graph_sees_the_house(graph: dict[str, set[str]]) -> None:
    """The reader finds the rooms and their arrows (a broken reader would pass the rest)."""
    assert len(graph) > 200
    assert "chunkd.cache.tier" in graph["chunkd.cache.ram"]
    assert "chunkd.errors" in graph["chunkd.client.core"]
    assert "chunkd.snapshot.member" in graph["chunkd.snapshot.pages"]  # a package of src/
    assert sum(len(targets) for targets in graph.values()) > 1000


def test_no_circle(graph: dict[str, set[str]]) -> None:
    circles = _circles(graph)
    shown = [
        " <-> ".join(circle)
        + "\n    "
        + "\n    ".join(f"{a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle)
        for circle in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(shown)


def test_no_arrow_back_up(graph: dict[str, set[str]]) -> None:
    wrong = [
        f"{source} -> {target}: {problem}"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if (problem := _floor_problem(source, target)) is not None
    ]
    assert not wrong, "arrows running back up:\n" + "\n".join(wrong)


def test_finds_a_circle_and_an_arrow_up() -> None:
    """The checks can fail: a made-up circle and a made-up upward arrow are caught."""
    made_up = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(made_up) == [["a", "b", "c"]]
    assert _floor_problem("chunkd.cache.disk", "chunkd.gateway.daemon") is not None
    assert _floor_problem("chunkd.client.core", "chunkd.cache.tier") is not None
    assert _floor_problem("chunkd.gateway.readpath", "chunkd.client.datasets.loader")
    assert _floor_problem("chunkd.gateway.cli.ckpt", "chunkd.client.checkpoint") is None
    assert _floor_problem("chunkd.snapshot", "chunkd.errors") is None


if __name__ == "__main__":  # pragma: no cover - a quick look by hand
    g = _graph(_modules())
    for c in _circles(g):
        print(c)
    sys.exit(0)
