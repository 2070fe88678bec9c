"""compat/imports.py: Lightning's torchmetrics probe is skipped in ppo-fabric's processes, and only there.

A stand-in `torchmetrics` package (version 1.5.0) that notes each import of it in a file plays the CUDA
image's. Each case runs in a fresh interpreter: what is imported is per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_torchmetrics(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that finds the stand-in torchmetrics; its imports go to `imports.txt`."""
    package = tmp_path / "site" / "torchmetrics"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        'import os\n__version__ = "1.5.0"\nwith open(os.environ["TORCHMETRICS_IMPORTS"], "a") as f:\n'
        '    f.write("imported\\n")\n'
    )
    path = os.pathsep.join([str(tmp_path / "site"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, TORCHMETRICS_IMPORTS=str(tmp_path / "imports.txt"))


def imports(env: dict[str, str]) -> int:
    path = Path(env["TORCHMETRICS_IMPORTS"])
    return len(path.read_text().splitlines()) if path.exists() else 0


def python(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.slow  # a fresh process's imports
def test_lightning_still_imports_torchmetrics_to_probe_its_version(fake_torchmetrics: dict[str, str]) -> None:
    """Lightning's own behaviour, which the finder exists for. If this fails, Lightning no longer imports
    torchmetrics when it is imported: compat/imports.py and its call in cli.console_main can go."""
    out = python(
        """
        import lightning_fabric.utilities.imports as probe
        print(probe._TORCHMETRICS_GREATER_EQUAL_1_0_0)
        """,
        fake_torchmetrics,
    )
    assert out == "True"
    assert imports(fake_torchmetrics) == 1


@pytest.mark.slow  # a fresh process's imports
def test_the_finder_skips_the_probe_and_nothing_else(fake_torchmetrics: dict[str, str]) -> None:
    """With the finder, importing Lightning leaves torchmetrics unimported (Lightning reads it as missing);
    a later import of torchmetrics by anyone works as usual."""
    out = python(
        """
        import sys
        from ppo_fabric.compat.imports import skip_torchmetrics_probe
        assert skip_torchmetrics_probe()
        import lightning_fabric
        from lightning_fabric import Fabric
        import lightning_fabric.utilities.imports as probe
        print(probe._TORCHMETRICS_GREATER_EQUAL_1_0_0, "torchmetrics" in sys.modules)
        import torchmetrics
        print(torchmetrics.__version__, skip_torchmetrics_probe())  # installed once, not again
        """,
        fake_torchmetrics,
    )
    assert out.splitlines() == ["False False", "1.5.0 False"]
    assert imports(fake_torchmetrics) == 1  # the later import only


@pytest.mark.slow  # a fresh process's imports
def test_a_command_line_run_never_imports_torchmetrics(
    fake_torchmetrics: dict[str, str], tmp_path: Path
) -> None:
    """`python -m ppo_fabric`: the supervising process and the job's process both train without importing
    the stand-in torchmetrics. (~6 s: only a real command line's processes prove where the finder is
    installed.)"""
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_fabric", "algo.total_steps=256", "env.num_envs=2", "algo.rollout_steps=128",
         "algo.minibatch_size=64", "logger=none", "checkpoint.every=0", f"hydra.run.dir={tmp_path / 'run'}"],
        env=fake_torchmetrics, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()
    assert imports(fake_torchmetrics) == 0
