"""The README's examples run as written, with small budgets: the Python snippet (twice, as a notebook cell
is rerun: `resume=auto` makes the second call return the finished run's summary) and the first command of
"Launching" in-process. The other commands start processes (a decoupled job, a sweep, a study); they compose
in `test_docs.test_documented_commands_compose` and run in tests/app, tests/strategies and tests/tune.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import ppo_fabric

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parent.parent / "README.md"
SMALL = "algo.total_steps=1024"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def test_the_python_snippet_runs_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (snippet,) = [b for b in _blocks("python") if "ppo_fabric.run(" in b]
    assert "algo.total_steps=50000" in snippet and "runs/cartpole" in snippet, (
        "the snippet changed: update this test"
    )
    code = snippet.replace("algo.total_steps=50000", SMALL)
    monkeypatch.chdir(tmp_path)  # runs/cartpole under the test's directory
    first: dict = {}
    exec(compile(code, "README.md", "exec"), first)
    again: dict = {}
    exec(compile(code, "README.md", "exec"), again)  # rerun: the finished run's summary, no error
    assert first["summary"] == again["summary"] and first["summary"]["total_env_steps"] == 1024
    assert first["env"].action_space.contains(first["action"])


def test_the_first_launch_command_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = [b for b in _blocks("bash") if "python -m ppo_fabric env.id=Acrobot-v1" in b]
    line = next(ln for ln in block.splitlines() if ln.startswith("python -m ppo_fabric env.id=Acrobot-v1"))
    words = shlex.split(line.split(" #")[0])[3:]
    summary = ppo_fabric.run([*words, SMALL, f"hydra.run.dir={tmp_path / 'run'}"])
    assert summary["env_id"] == "Acrobot-v1" and summary["total_env_steps"] >= 1024
    assert "Acrobot-v1 with env=gym, the generic defaults" in capsys.readouterr().out
