"""The package's layout rules, checked on its import graph (imports inside functions included):
no cycle, the subpackages form layers (a lower one never imports a higher one, the root's entry points are
imported by none of them), the root holds only the public face and the entry points, neither strategy
imports the other, the config module imports nothing of the package, and torch.distributed is used only by
the protocol module."""

from __future__ import annotations

import ast
import re
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
    assert "ppo_fabric.ppo" in graph and "ppo_fabric.wire.protocol" in graph
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
    assert import_graph()["ppo_fabric.config.values"] == set()


def test_torch_distributed_only_in_the_protocol() -> None:
    users = sorted(
        module_name(p)
        for p in PACKAGE.rglob("*.py")
        if "torch.distributed" in p.read_text() and module_name(p) != "ppo_fabric.wire.protocol"
    )
    assert users == []


# Lowest first. A subpackage may import its own modules and those of lower layers; packages on one layer
# never import each other. The docs' architecture page draws this table.
LAYERS: list[set[str]] = [
    {"compat", "config", "wire"},
    {"envs", "models"},
    {"games"},
    {"learn"},
    {"collect"},
    {"runs"},
    {"policy"},
    {"app"},
    {"tune"},
]
# The package root: the public face (`__init__`: run, load_policy) and the entry points.
ROOT_MODULES = {"__init__", "__main__", "cli", "ppo", "ppo_decoupled", "evaluate", "export"}


def layer_of(module: str) -> int | None:
    """The layer of a subpackage's module, None for a root module."""
    parts = module.split(".")
    if len(parts) < 2 or (len(parts) == 2 and not (PACKAGE / parts[1]).is_dir()):
        return None
    return next(i for i, names in enumerate(LAYERS) if parts[1] in names)


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in graph.items():
        here = layer_of(module)
        if here is None:
            continue  # the root may import any layer
        for dep in deps:
            there = layer_of(dep)
            if there is None:
                bad.append(f"{module} imports the root's {dep}")
            elif there > here or (there == here and dep.split(".")[1] != module.split(".")[1]):
                bad.append(f"{module} (layer {here}) imports {dep} (layer {there})")
    return sorted(bad)


def test_every_subpackage_has_a_layer() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set().union(*LAYERS)


def test_subpackages_form_layers() -> None:
    assert layering_violations(import_graph()) == []


def test_layering_check_can_fail() -> None:
    """An import from a lower layer up, one across a layer and one of a root entry point are all caught."""
    graph = {
        "ppo_fabric.envs.make": {
            "ppo_fabric.learn.update",
            "ppo_fabric.models.agent",
            "ppo_fabric.config.values",
        },
        "ppo_fabric.config.values": {"ppo_fabric.ppo"},
    }
    assert layering_violations(graph) == [
        "ppo_fabric.config.values imports the root's ppo_fabric.ppo",
        "ppo_fabric.envs.make (layer 1) imports ppo_fabric.learn.update (layer 3)",
        "ppo_fabric.envs.make (layer 1) imports ppo_fabric.models.agent (layer 1)",
    ]


def test_root_holds_only_the_public_face_and_entry_points() -> None:
    assert {p.stem for p in PACKAGE.glob("*.py")} == ROOT_MODULES


LONGEST_FUNCTION = 60  # lines, signature and docstring included: PPO read top to bottom, a screen at a time


def long_functions(folders: tuple[str, ...], limit: int) -> dict[tuple[str, str], int]:
    out = {}
    for folder in folders:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines > limit:
                        out[(path.relative_to(PACKAGE).as_posix(), node.name)] = lines
    return out


def test_ppo_reads_in_short_functions() -> None:
    assert long_functions(("learn", "collect"), LONGEST_FUNCTION) == {}


def test_the_rollout_reads_what_an_env_can_do_from_its_traits() -> None:
    """What a vector env can do (agents, turns, an async pool) is its declared `envs.traits.VectorEnvTraits`;
    nothing in the loop's layers probes an env for attributes with `getattr`/`hasattr`."""
    probes = []
    for folder in ("collect", "learn", "runs"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
                    target = ast.unparse(node.args[0])
                    if node.func.id in ("getattr", "hasattr") and target.split(".")[-1] == "envs":
                        probes.append(
                            f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno} {ast.unparse(node)}"
                        )
    assert probes == []


def config_defaults_repeated(root: Path) -> list[str]:
    """`.get("key", default)` on a config, where `key` has a default in conf/ (`config.defaults.schema`)."""
    from ppo_fabric.config.defaults import leaves, schema

    keys = {path[-1] for path, _ in leaves(schema())}
    receivers = re.compile(r"(^|\.)(cfg|algo|env_cfg|env|sp|sp_cfg|selfplay|logger|eval|fabric|checkpoint)$")
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "get" or len(node.args) < 2 or not isinstance(node.args[0], ast.Constant):
                continue
            if node.args[0].value in keys and receivers.search(ast.unparse(node.func.value)):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {ast.unparse(node)}")
    return found


def test_config_defaults_are_written_once() -> None:
    """A key's default is its YAML in conf/; code reads the key (configs from checkpoints and by hand are
    completed by `config.defaults.with_defaults`), never a `.get(key, default)` copy that can drift."""
    assert config_defaults_repeated(PACKAGE) == []


def test_the_strategies_name_what_they_pass_to_the_update() -> None:
    """After the batches, every argument of `update_policies` is keyword-only: the step, the schedule and
    the lag cannot be swapped unnoticed."""
    import inspect

    from ppo_fabric.learn.update import update_policies, update_policy

    for function, positional in ((update_policies, 3), (update_policy, 5)):
        kinds = [p.kind for p in inspect.signature(function).parameters.values()]
        assert kinds[positional:] == [inspect.Parameter.KEYWORD_ONLY] * (len(kinds) - positional)


MUTATORS = {"append", "extend", "clear", "update", "pop", "add", "insert", "remove"}


def collector_writes(package: Path = PACKAGE) -> list[str]:
    """Places outside collect/ that assign to a rollout collector's attributes (`collector.x = ...`,
    `self.collector.x.y += ...`) or mutate them in place (`collector.episodes.window.extend(...)`)."""

    def rooted(node: ast.AST) -> bool:
        while isinstance(node, ast.Attribute):
            if (isinstance(node.value, ast.Name) and node.value.id == "collector") or (
                isinstance(node.value, ast.Attribute) and node.value.attr == "collector"
            ):
                return True
            node = node.value
        return False

    out = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "collect":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
            ):
                targets = [node.func.value]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and rooted(leaf):
                        out.append(f"{path.relative_to(package.parent)}:{node.lineno}")
                        break
    return out


def test_the_collector_owns_its_state() -> None:
    """The session and the strategies save and restore a collector through its `state_dict` /
    `load_state_dict`, never by writing its envs, windows or observations themselves."""
    assert collector_writes() == []


def test_collector_writes_are_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "def f(collector, s):\n    collector.envs = 1\n    s.collector.episodes.window.extend([])\n"
        "    n = collector.num_envs\n"
    )
    assert collector_writes(tmp_path / "pkg") == ["pkg/m.py:2", "pkg/m.py:3"]
