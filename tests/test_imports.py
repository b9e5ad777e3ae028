"""The package's import graph: no circle, and every module imports on its own."""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "moddiffy_jax"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """Package modules imported anywhere in ``tree`` (function bodies too),
    except under ``if TYPE_CHECKING:``."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in out if m in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {
        name: _imports(ast.parse(path.read_text()), modules) - {name}
        for name, path in paths.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_find_cycle_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_type_checking_imports_are_not_edges():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\n"
        "def f():\n    import x.z\n"
    )
    assert _imports(tree, {"x.y", "x.z"}) == {"x.z"}


def test_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_every_module_imports_in_any_order(order):
    names = sorted(import_graph())
    if order == "reversed":
        names.reverse()
    code = f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _is_main_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
    )


@pytest.mark.parametrize("folder", ["moddiffy_jax", "benchmarks"])
def test_the_main_guard_comes_last(folder):
    """A script's ``if __name__ == "__main__":`` is its last statement: a
    function defined below it does not exist yet when the script runs (stop
    61: the main job's summary called one and failed at its very end, while
    every test that imports the module passed)."""
    late = []
    for path in sorted((PACKAGE.parent / folder).rglob("*.py")):
        body = ast.parse(path.read_text()).body
        guards = [i for i, node in enumerate(body) if _is_main_guard(node)]
        if guards and guards[-1] != len(body) - 1:
            late.append(str(path.relative_to(PACKAGE.parent)))
    assert not late, f"statements after the main guard in {late}"
