"""The README and the docs site (docs/, mkdocs.yml) against the code: the README stays a front door, every
relative link resolves, every documented `python -m ppo_fabric` command composes with keys that exist, the
architecture page's layers are the ones tests/test_architecture.py enforces, the generated
configuration reference describes every key, and conf/ and the notebooks point at docs pages and headings
that exist (never at README sections). `make test` also builds the site with `mkdocs build --strict`."""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.util
import json
import re
import shlex
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from markdown.extensions.toc import slugify
from omegaconf import OmegaConf

from ppo_fabric.config.values import ConfigError, check_values, compose
from tests.test_architecture import LAYERS

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").rglob("*.md"))
DOCUMENTS = [README, *PAGES]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
GENERATED = re.compile(r"<!-- config-reference -->|^--8<--", re.M)  # headings made at build time
COMMAND = re.compile(r"(?:python -m ppo_fabric|ppo-fabric|ppo_fabric/ppo(?:_decoupled)?\.py)(?=\s|$)(.*)")


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """Python-Markdown's toc anchor of a heading: its text (links, code spans and emphasis as plain text)
    through the toc extension's default slugify, which mkdocs.yml keeps (`toc: permalink: true` only)."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("**", "")
    return slugify(text.strip(), "-")


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file outside code blocks and code spans."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))
    return LINK.findall(text)


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    assert any("make test" in line for line in lines), "CI runs the README's test command"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files(path: Path) -> None:
    broken = []
    for target in links(path):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve()
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and not GENERATED.search(resolved.read_text()):
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", resolved.read_text()), re.M)
            if anchor not in {slug(h) for h in headings}:
                broken.append(target)
    assert broken == []


def documented_overrides(text: str) -> list[list[str]]:
    """The overrides of every plain training command in a Markdown text: in code blocks, code spans and
    `ppo_fabric.run([...])` calls. Commands with shell variables, prompts, placeholders or Hydra flags
    (-m, --cfg, --config-path, ...) are left out: they cannot be composed as they are."""
    snippets = [line for block in FENCE.findall(text) for line in block.replace("\\\n", " ").splitlines()]
    snippets += re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    commands = []
    for snippet in snippets:
        match = COMMAND.search(snippet.split(" #")[0])
        if match is None or "$" in snippet or "<" in snippet or "..." in snippet:
            continue
        words = shlex.split(match.group(1))
        if words and all("=" in w and not w.startswith("-") for w in words):
            commands.append(words)
    for call in re.findall(r"ppo_fabric\.run\(\s*(\[.*?\])\s*\)", text, re.S):
        if call != "[...]":  # prose naming the function
            commands.append(ast.literal_eval(call))
    return commands


def compose_checked(overrides: list[str]) -> None:
    cfg, _ = compose(overrides)
    check_values(cfg)


@pytest.mark.slow
def test_documented_commands_compose() -> None:
    commands = [(path, c) for path in DOCUMENTS for c in documented_overrides(path.read_text())]
    assert len(commands) >= 40, "the command finder stopped finding the docs' commands"
    failures = []
    for path, overrides in commands:
        try:
            compose_checked(overrides)
        except ConfigError as exc:
            failures.append(f"{path.relative_to(REPO)}: {' '.join(overrides)}: {exc}")
    assert failures == []


def test_the_command_check_can_fail() -> None:
    text = "```bash\npython -m ppo_fabric env=lunarlander algo.lrr=3e-4   # a typo\n```\n"
    (overrides,) = documented_overrides(text)
    assert overrides == ["env=lunarlander", "algo.lrr=3e-4"]
    with pytest.raises(ConfigError, match="algo.lrr"):
        compose_checked(overrides)
    assert (
        documented_overrides("`python -m ppo_fabric -m seed=1,2`, `python -m ppo_fabric <overrides>`") == []
    )


def test_architecture_page_draws_the_enforced_layers() -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", page, re.M)
    assert [set(re.findall(r"`(\w+)`", names)) for _, names in rows] == LAYERS
    assert [int(n) for n, _ in rows] == list(range(1, len(LAYERS) + 1))


def flat_keys(node: object, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [k for key, sub in node.items() for k in flat_keys(sub, f"{prefix}{key}.")]
    return [prefix[:-1]]


@pytest.mark.slow
def test_configuration_reference_describes_every_key() -> None:
    reference = hooks().config_reference()
    rows = dict(re.findall(r"^\| `([^`]+)` \| `[^`]*` \| (.*) \|$", reference, re.M))
    keys = flat_keys(OmegaConf.to_container(compose([])[0], resolve=False))
    assert len(keys) > 50
    assert [k for k in keys if k not in rows] == []
    assert [k for k in keys if not rows[k].strip()] == [], "give these keys a comment in conf/ (or MEANINGS)"
    for group in ("env", "exp", "model", "logger"):
        for option in (REPO / "conf" / group).glob("*.yaml"):
            assert f"#### `{group}={option.stem}`" in reference


def test_comments_are_read_from_the_yaml_text(tmp_path: Path) -> None:
    yaml = tmp_path / "opt.yaml"
    yaml.write_text(
        "# The option.\n# Two lines.\n\n"
        "a: 1      # trailing\n"
        "          # and continued\n"
        "# above b\n"
        "b:\n"
        "  c: x    # nested | piped\n"
        "defaults:\n  - d: e   # not a key\n"
    )
    header, meanings = hooks().file_comments(yaml, "g.")
    assert header == "The option.\nTwo lines."
    assert meanings == {"g.a": "trailing and continued", "g.b": "above b", "g.b.c": "nested | piped"}


def test_files_from_outside_docs_exist() -> None:
    outside = hooks().outside_files()
    assert "notebooks/quickstart.ipynb" in outside and any(p.endswith(".png") for p in outside)
    assert [p for p in outside if not (REPO / p).is_file()] == []


# --------------------------------------------------------------- pointers from conf/ and the notebooks
# `docs/how-to/pixels.md#envpool-backend`: a docs page and one of its headings, as conf/ comments and the
# notebooks cite them (docs/hooks.py turns those in conf/ into links in the configuration reference).
DOCS_REF = re.compile(r"\bdocs/((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?")
RESULT_REF = re.compile(r"\bbenchmarks/[\w/*.-]*\w")  # a benchmark script, result file or glob of them
CONF_FILES = sorted((REPO / "conf").rglob("*.yaml"))
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def anchors(markdown: str) -> set[str]:
    """The toc anchors of a Markdown text's headings outside code blocks; a repeated one gets `_1`, `_2`,
    ... as Python-Markdown numbers them."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", FENCE.sub("", markdown), re.M):
        base = anchor = slug(heading)
        n = 0
        while anchor in found:
            n += 1
            anchor = f"{base}_{n}"
        found.add(anchor)
    return found


def page_text(page: str, generated: bool = False) -> str:
    """docs/`page` as the site renders it: snippets (`--8<-- "path"`) included; with `generated`, the
    configuration reference's marker replaced by the tables docs/hooks.py makes at build time (seconds)."""
    text = SNIPPET.sub(lambda m: (REPO / m[1]).read_text(), (REPO / "docs" / page).read_text())
    return text.replace("<!-- config-reference -->", generated_reference()) if generated else text


@functools.cache
def generated_reference() -> str:
    return hooks().config_reference()


def pointer_text(path: Path) -> str:
    """What a conf/ file or a notebook says: the YAML text whole (comments, help template); a notebook's
    cells' sources, outputs left out."""
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
    return path.read_text()


def has_anchor(page: str, anchor: str, generated: bool) -> bool:
    """Whether docs/`page` has the heading `anchor`; true, unchecked, for a page with generated headings
    unless `generated`."""
    text = page_text(page)
    if anchor in anchors(text):
        return True
    if not GENERATED.search(text):
        return False
    return not generated or anchor in anchors(page_text(page, generated=True))


def broken_pointers(text: str, generated: bool = False) -> list[str]:
    """The docs pointers of `text` whose page or heading does not exist, the benchmark paths that match no
    file, and every mention of a README (its sections move; a docs page and heading is what to cite). An
    anchor of a page with generated headings is checked only with `generated` (it builds the tables)."""
    broken = [f"README: {line.strip()}" for line in text.splitlines() if "README" in line]
    for match in DOCS_REF.finditer(text):
        page, anchor = match[1], match[2]
        if not (REPO / "docs" / page).is_file():
            broken.append(f"no page: {match[0]}")
        elif anchor and not has_anchor(page, anchor, generated):
            broken.append(f"no heading: {match[0]}")
    broken += [f"no file: {m[0]}" for m in RESULT_REF.finditer(text) if not any(REPO.glob(m[0]))]
    return broken


@pytest.mark.parametrize("path", [*CONF_FILES, *NOTEBOOKS], ids=lambda p: str(p.relative_to(REPO)))
def test_conf_and_notebooks_point_at_docs_headings_that_exist(path: Path) -> None:
    assert broken_pointers(pointer_text(path)) == []


@pytest.mark.slow
def test_pointers_into_the_generated_reference_exist() -> None:
    """Anchors of the configuration reference's generated tables (`#defaults`, `#env`, ...)."""
    cited = [
        m[0]
        for path in [*CONF_FILES, *NOTEBOOKS]
        for m in DOCS_REF.finditer(pointer_text(path))
        if m[2] and GENERATED.search(page_text(m[1]))
    ]
    assert cited, "nothing cites the generated reference's headings: this test checks nothing"
    assert broken_pointers("\n".join(cited), generated=True) == []


def test_the_pointer_check_can_fail() -> None:
    assert (
        broken_pointers(
            "backend: gymnasium  # envpool: docs/how-to/pixels.md#envpool-backend, docs/performance.md\n"
            "# docs/reference/configuration.md#normalisation; benchmarks/results/learning_classic.md\n"
        )
        == []
    )
    assert broken_pointers(
        '# README "EnvPool backend"\n'
        "# docs/how-to/pixels.md#envpool (the heading is EnvPool backend)\n"
        "# docs/how-to/nosuch.md#x; benchmarks/results/nosuch*.md\n"
    ) == [
        'README: # README "EnvPool backend"',
        "no heading: docs/how-to/pixels.md#envpool",
        "no page: docs/how-to/nosuch.md#x",
        "no file: benchmarks/results/nosuch*.md",
    ]
    assert anchors("# A\n## `env`\n```\n# not a heading\n```\n## env\n") == {"a", "env", "env_1"}


# --------------------------------------------------------------- benchmarks/results: every file cited
# The results folder keeps what the docs quote and nothing else: a report nobody cites is a figure nobody can
# find, and files pile up run after run. Cited means named by the docs, the READMEs, conf/, the code or a
# cited report, by name or by a glob or brace pattern (`learning_games_greedy.*`, `faults_sps_*_after.md`,
# `results/chaos.{json,md}`); a cited report carries its data and plots (same stem, `_profile`, `_stats`).
RESULTS = REPO / "benchmarks" / "results"
FILE_CITE = re.compile(r"[A-Za-z]\w\w[\w*{},.-]*?\.(?:\*|\{[\w,]+\}|(?:md|json|png|csv|log)\b)")
# a path under results/ as the docs write it; `git show REV:` in front cites history, not the tree
PATH_CITE = re.compile(r"(git show \w+:)?\b(?:benchmarks/)?results/([\w*.{},-]*+)(?<=[\w}])(?!<)")
CITING_SUFFIXES = (".md", ".py", ".yaml", ".sh", ".ipynb", ".toml")


def braces(pattern: str) -> list[str]:
    """`a.{json,md}` -> [`a.json`, `a.md`] (fnmatch has no braces)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m[1].split(",") for x in braces(pattern[: m.start()] + alt + pattern[m.end() :])]


def cited_results(texts: list[str], reports: dict[str, str]) -> set[str]:
    """The names of `reports` (file name -> text, "" for data) that `texts` cite, directly, through cited
    reports' own citations, or as the data beside a cited report."""
    names = list(reports)

    def cites(text: str) -> set[str]:
        return {
            n for token in FILE_CITE.findall(text) for p in braces(token) for n in fnmatch.filter(names, p)
        }

    cited = set().union(*map(cites, texts))
    todo = list(cited)
    while todo:
        new = cites(reports[todo.pop()]) - cited
        cited |= new
        todo += new
    stems = {n.rsplit(".", 1)[0] for n in cited}
    return cited | {n for n in names if re.sub(r"_(profile|stats)$", "", n.rsplit(".", 1)[0]) in stems}


def citing_texts() -> list[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    paths = [
        p
        for p in tracked.stdout.split()
        if p.endswith(CITING_SUFFIXES) and not p.startswith("benchmarks/results/")
    ]
    return [(REPO / p).read_text(errors="ignore") for p in paths if (REPO / p).is_file()]


def tracked_results() -> list[Path]:
    """The result files in git: a sitting's new report is not one until it is committed with the page that
    quotes it (`make bench` writes some the pages do not quote yet)."""
    listed = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()  # fmt: skip
    return [REPO / p for p in listed if (REPO / p).is_file()]


def test_every_result_file_is_cited_and_every_cited_one_exists() -> None:
    reports = {p.name: p.read_text() if p.suffix == ".md" else "" for p in tracked_results()}
    texts = citing_texts()
    assert sorted(set(reports) - cited_results(texts, reports)) == []
    pages = [page_text(str(p.relative_to(REPO / "docs"))) for p in (REPO / "docs").rglob("*.md")]
    missing = [
        m[0]
        for text in [*pages, (REPO / "README.md").read_text()]
        for m in PATH_CITE.finditer(text)
        if not m[1] and not any(RESULTS.glob(p) for p in braces(m[2]))
    ]
    assert missing == []


def test_the_citation_check_can_fail() -> None:
    reports = {"run_a.md": "see run_b.png", "run_a.json": "", "run_b.png": "", "run_c_profile.png": "",
               "run_c.md": "", "run_d.log": "", "run_e.md": "", "run_f.md": ""}  # fmt: skip
    texts = ["`results/run_a.md`", "the runs (`run_c.*`) and `run_e.{json,md}`; git show 1:results/run_d.log"]
    cited = {"run_a.md", "run_a.json", "run_b.png", "run_c.md", "run_c_profile.png", "run_e.md", "run_d.log"}
    assert cited_results(texts, reports) == cited  # run_f.md: cited by nothing
    assert cited_results(["nothing here; `*.md` is every report, not a citation"], reports) == set()
    assert [m[0] for m in PATH_CITE.finditer("results/x.{json,md} results/learning_<suite>.json")] == [
        "results/x.{json,md}"
    ]
