"""MkDocs hooks (`hooks:` in mkdocs.yml): files from outside docs/, and the configuration reference.

- `on_files`: the quickstart notebook and the benchmark figures join the site under their repository paths,
  read where they are (nothing is copied into docs/).
- `on_page_markdown`: a link written relative to the page's file on disk (so it works on GitHub too) that
  points at one of those files is rewritten to its place in the site; the marker `<!-- config-reference -->`
  becomes the tables of `config_reference()`, generated from conf/ at every build so they cannot drift.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

import yaml
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
MARKER = "<!-- config-reference -->"
LINK = re.compile(r"(\]\()([^)\s#]+)")
GROUPS = ["algo", "env", "model", "fabric", "logger", "selfplay", "exp"]  # conf/config.yaml's defaults
# A conf/ comment's pointer at a docs page (`docs/how-to/pixels.md#envpool-backend`): (page, anchor).
DOCS_REF = re.compile(r"\bdocs/((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HERE = "reference"  # the configuration reference's folder in docs/, which its links are relative to
# Meanings of the keys conf/ leaves without a comment.
MEANINGS = {
    "algo.update_epochs": "passes over the batch per update",
    "algo.lr": "Adam's learning rate (annealed when `anneal_lr`)",
    "algo.adam_eps": "Adam's epsilon",
    "algo.gamma": "discount factor",
    "algo.gae_lambda": "GAE's lambda",
    "algo.clip_coef": "the surrogate's clip range (and the value's, with `clip_vloss`)",
    "algo.vf_coef": "weight of the value loss",
    "algo.ent_coef": "weight of the entropy bonus",
    "env.id": "a gymnasium id, `module:Env-v0` (the module registers it) or `module:callable` (returns the env)",
    "env.num_envs": "E: envs per collecting rank",
    "env.api": "pettingzoo: a PettingZoo env (Parallel or AEC)",
    "model.actor_hidden": "widths of the actor's hidden layers",
    "model.critic_hidden": "widths of the critic's hidden layers",
    "fabric.accelerator": "cpu | cuda | gpu | mps | auto",
    "fabric.num_nodes": "nodes of the job",
    "fabric.precision": "Fabric's precision: 32-true, bf16-mixed, ...",
    "logger.tensorboard": "write tensorboard/ in the run directory",
    "logger.csv": "write metrics.csv in the run directory",
    "logger.project": "the W&B project",
    "selfplay.enabled": "self-play against snapshots of the learner (two-player AEC games)",
}


def outside_files() -> list[str]:
    """Repository files the site shows from outside docs/."""
    figures = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks/results").glob("*.png"))
    return ["notebooks/quickstart.ipynb", *figures]


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the notebook into a page
def on_files(files: Files, config: Any) -> Files:
    for path in outside_files():
        files.append(File(path, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    outside, page_dir = set(outside_files()), Path(page.file.abs_src_path).parent

    def relink(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith("/"):
            return match.group(0)
        path = (page_dir / target).resolve()
        if not path.is_relative_to(ROOT) or path.relative_to(ROOT).as_posix() not in outside:
            return match.group(0)
        here = posixpath.dirname(page.file.src_uri)
        return match.group(1) + posixpath.relpath(path.relative_to(ROOT).as_posix(), here or ".")

    markdown = LINK.sub(relink, markdown)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, config_reference())
    return markdown


# ----------------------------------------------------------------------------- the configuration reference
def file_comments(path: Path, prefix: str) -> tuple[str, dict[str, str]]:
    """(the file's header comment, dotted key -> meaning): a key's trailing comment, continued on the
    comment-only lines indented below it, else the comment block right above it. `defaults` and `hydra`
    are skipped."""
    header, meanings, stack, above, last = [], {}, [], [], None
    started = skip = False
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment = stripped.lstrip("#").strip()
            if not started:
                header += [] if comment.startswith("@package") else [comment]
            elif last and line.index("#") > last[1]:
                meanings[last[0]] += " " + comment
            else:
                above, last = [*above, comment], None
            continue
        started = started or bool(stripped)
        match = re.match(r"(\s*)([A-Za-z_]\w*):\s*([^#]*?)\s*(?:#\s?(.*))?$", line)
        if not match:
            above, last = [], None
            continue
        indent, name, value, trailing = len(match[1]), match[2], match[3], match[4]
        stack = [(i, n) for i, n in stack if i < indent]
        skip = (skip and indent > 0) or (indent == 0 and name in ("defaults", "hydra"))
        key = prefix + ".".join([n for _, n in stack] + [name])
        if not skip:
            meanings[key] = trailing or " ".join(above)
        if not value:
            stack.append((indent, name))
        above, last = [], ((key, indent) if trailing and not skip else None)
    return "\n".join(header), {k: v for k, v in meanings.items() if v}


def option_file(group: str, option: str) -> tuple[str, dict[str, str]]:
    path = CONF / group / f"{option}.yaml"
    global_package = path.read_text().startswith("# @package _global_")
    return file_comments(path, "" if global_package else f"{group}.")


def default_options() -> dict[str, str]:
    """Group -> its default option, from conf/config.yaml's defaults list (exp has none)."""
    entries = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items() if k in GROUPS and v}


def selected(group: str, option: str) -> list[str]:
    """The options of other groups that an option selects (`override /env: atari` in its defaults)."""
    entries = yaml.safe_load((CONF / group / f"{option}.yaml").read_text()).get("defaults", [])
    return [f"{k.split()[-1].strip('/')}={v}" for e in entries if isinstance(e, dict) for k, v in e.items()]


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        return {k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def composed(overrides: list[str]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from ppo_fabric.config.values import compose

    return flat(OmegaConf.to_container(compose(overrides)[0], resolve=False))


def headings(page: str) -> dict[str, str]:
    """Anchor -> title of the headings of docs/`page` (outside code blocks), anchors as the toc extension
    makes them (mkdocs.yml keeps its default slugify); the first heading, the page's title, also under ""."""
    from markdown.extensions.toc import slugify

    titles: dict[str, str] = {}
    for title in re.findall(r"^#{1,6} (.+?)\s*#*$", FENCE.sub("", (ROOT / "docs" / page).read_text()), re.M):
        plain = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
        titles.setdefault("", plain)
        titles.setdefault(slugify(plain, "-"), plain)
    return titles


def text(comment: str) -> str:
    """A conf/ comment as Markdown: its pointers at docs pages (`docs/PAGE.md#ANCHOR`) as links titled with
    the heading they point at (mkdocs' strict build then checks page and anchor)."""

    def link(match: re.Match[str]) -> str:
        page, anchor = match[1], match[2] or ""
        path = ROOT / "docs" / page
        title = headings(page).get(anchor) if path.is_file() else None
        target = posixpath.relpath(page, HERE) + (f"#{anchor}" if anchor else "")
        return f"[{title or match[0]}]({target})"

    return DOCS_REF.sub(link, comment).replace("<", "&lt;")


def table(rows: dict[str, Any], meanings: dict[str, str], head: str = "default") -> str:
    def meaning(key: str) -> str:  # a key without one (env.kwargs.N) takes its parent's
        return meanings.get(key) or (meaning(key.rpartition(".")[0]) if "." in key else "")

    def value(v: Any) -> str:
        shown = "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v).replace("'", "")
        return f"`{shown}`"

    lines = [f"| key | {head} | meaning |", "|---|---|---|"]
    cells = [(k, value(v), text(meaning(k)).replace("|", "\\|")) for k, v in rows.items()]
    lines += [f"| `{k}` | {v} | {m} |" for k, v, m in cells]
    return "\n".join(lines)


def base_meanings() -> dict[str, str]:
    """Every key's meaning for the defaults: config.yaml's comments, else the default options', else
    MEANINGS, else the other options'."""
    defaults, others, chosen = default_options(), {}, {}
    for group in GROUPS:
        for path in sorted((CONF / group).glob("*.yaml")):
            (chosen if defaults.get(group) == path.stem else others).update(option_file(group, path.stem)[1])
    return others | MEANINGS | chosen | file_comments(CONF / "config.yaml", "")[1]


def config_reference() -> str:
    """Markdown: every key of the composed default config with its default and meaning, then every option
    of every config group with its description and what it changes."""
    base, meanings, defaults = composed([]), base_meanings(), default_options()
    sections: dict[str, dict[str, Any]] = {"top level": {}}
    for key, value in base.items():
        sections.setdefault(key.split(".")[0] if "." in key else "top level", {})[key] = value
    out = ["## Defaults", "", "`python -m ppo_fabric` with no override composes these values.", ""]
    for name, rows in sections.items():
        out += [f"### {name if name == 'top level' else f'`{name}`'}", "", table(rows, meanings), ""]
    out += ["## Config groups", ""]
    for group in GROUPS:
        options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        out += [f"### `{group}`", "", "Options: " + ", ".join(f"`{group}={o}`" for o in options) + ".", ""]
        for option in options:
            header, own = option_file(group, option)
            default = defaults.get(group) == option
            out += [f"#### `{group}={option}`" + (" (default)" if default else ""), "", text(header), ""]
            if selected(group, option):
                out += ["Selects " + ", ".join(f"`{s}`" for s in selected(group, option)) + ".", ""]
            changed = {
                k: v for k, v in composed([f"{group}={option}"]).items() if k not in base or base[k] != v
            }
            if default or not changed:
                out += ["Its values are the defaults above." if default else "It changes no default.", ""]
            else:
                out += [table(changed, meanings | own, "value"), ""]
    return "\n".join(out)
