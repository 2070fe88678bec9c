"""The package's layout rules, checked on its import graph (imports inside functions included):
no cycle, neither strategy imports the other, `config.py` imports nothing of the package, and
torch.distributed is used only by the protocol module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ppo_fabric"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """Package modules a module imports anywhere in its body: `from ppo_fabric import x` counts as
    `ppo_fabric.x` when x is a module, else as the package itself."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name.split(".")[0] == "ppo_fabric"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ppo_fabric":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p, package): p for p in package.rglob("*.py")}
    known = set(files)
    return {name: imported(ast.parse(path.read_text()), known) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by depth-first search (each reported once per entry point it is reached from)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert "ppo_fabric.ppo" in graph and "ppo_fabric.protocol" in graph
    assert cycles(graph) == []


def test_cycle_finder_finds_a_hidden_cycle(tmp_path: Path) -> None:
    """The check can fail: an import inside a function closes a cycle."""
    pkg = tmp_path / "ppo_fabric"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ppo_fabric import b\n")
    (pkg / "b.py").write_text("def f():\n    from ppo_fabric.a import x\n")
    graph = import_graph(pkg)
    assert graph["ppo_fabric.a"] == {"ppo_fabric.b"} and graph["ppo_fabric.b"] == {"ppo_fabric.a"}
    assert cycles(graph) == [["ppo_fabric.a", "ppo_fabric.b", "ppo_fabric.a"]]


@pytest.mark.parametrize(("module", "forbidden"), [("ppo", "ppo_decoupled"), ("ppo_decoupled", "ppo")])
def test_strategies_do_not_import_each_other(module: str, forbidden: str) -> None:
    assert f"ppo_fabric.{forbidden}" not in import_graph()[f"ppo_fabric.{module}"]


def test_config_is_a_leaf() -> None:
    assert import_graph()["ppo_fabric.config"] == set()


def test_torch_distributed_only_in_the_protocol() -> None:
    users = sorted(
        module_name(p)
        for p in PACKAGE.rglob("*.py")
        if "torch.distributed" in p.read_text() and module_name(p) != "ppo_fabric.protocol"
    )
    assert users == []
