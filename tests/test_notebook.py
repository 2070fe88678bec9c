"""The quickstart notebook runs from top to bottom, headless, with the project's own interpreter.

A notebook is documentation that rots silently: an API rename breaks it and nothing else notices. This
executes every cell with nbclient in a fresh kernel and fails on the first error, with the cell's
traceback. The kernel is pinned to the interpreter running the tests (a kernelspec written into a temp
dir that JUPYTER_PATH puts first), so a `python3` kernel registered elsewhere on the machine, with
another environment and perhaps no ppo-fabric, cannot be picked up. The kernel works in a temp dir, so
the notebook's `runs/` lands there and not in the repository.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the dev extra (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="the dev extra (nbformat, nbclient, ipykernel)")
pytest.importorskip("ipykernel", reason="the dev extra (nbformat, nbclient, ipykernel)")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
KERNEL = "python3"


def pin_kernel(jupyter_dir: Path) -> None:
    """Write a `python3` kernelspec that starts ipykernel with this very interpreter."""
    spec_dir = jupyter_dir / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ppo-fabric tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def test_quickstart_is_committed_without_outputs() -> None:
    """Outputs hold machine-specific paths, timings and images: the committed file keeps only code."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code
    assert all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quickstart_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jupyter_dir = tmp_path / "jupyter"
    pin_kernel(jupyter_dir)
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_dir))
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    work = tmp_path / "work"
    work.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=120, resources={"metadata": {"path": str(work)}}
    )
    client.execute()  # raises CellExecutionError (with the cell's traceback) on the first failing cell

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) >= 2  # the learning curve and the rendered frame
    runs = [p for p in (work / "runs").glob("quickstart-*") if not p.name.endswith("-own-env")]
    assert len(runs) == 1
    own = json.loads((runs[0].with_name(runs[0].name + "-own-env") / "summary.json").read_text())
    assert own["env_id"] == "__main__:make_env"  # the notebook's own factory, passed as env=
    for name in ("metrics.csv", "summary.json", "eval.json", "checkpoints/last.ckpt"):
        assert (runs[0] / name).is_file(), name
