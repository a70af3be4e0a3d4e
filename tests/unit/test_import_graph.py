"""No import cycle inside dp_plugin/: every module imports only modules
below it, so a reader can walk the core bottom-up (type-only imports under
``if TYPE_CHECKING:`` aside). Imports inside functions count too: a lazy
import is a cycle hidden until the function runs."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "dp_plugin"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    return skip


def import_graph(root: Path = CORE) -> dict[str, set[str]]:
    """Module -> the dp_plugin modules it imports (anywhere in its body)."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_only(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                for alias in node.names:  # `from pkg import module` names the module
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths
                             else base)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_dp_plugin_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "dp_plugin.reduce.reducer" in graph and "dp_plugin.engines.base" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_check_finds_a_lazy_import_cycle(tmp_path: Path) -> None:
    """The walker itself: a cycle closed by an import inside a function is
    found, one under TYPE_CHECKING is not."""
    pkg = tmp_path / "dp_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from dp_plugin import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from dp_plugin.c import C\n"
                              "def f():\n    from dp_plugin.c import g\n")
    (pkg / "c.py").write_text("from dp_plugin.b import f\n")
    graph = import_graph(pkg)
    assert find_cycle(graph) == ["dp_plugin.b", "dp_plugin.c", "dp_plugin.b"]
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from dp_plugin.c import C\n")
    assert find_cycle(import_graph(pkg)) is None
