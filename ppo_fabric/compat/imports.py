"""Lightning Fabric's import without its torchmetrics version probe, in ppo-fabric's own processes.

When `lightning_fabric.utilities.imports` is imported it sets `_TORCHMETRICS_GREATER_EQUAL_1_0_0` with
lightning_utilities' `compare_version`. That function imports `torchmetrics` to read its version. On a
machine where torchmetrics is installed (CUDA images often ship it with torchvision and transformers), the
import pulls in `torchmetrics.functional` and, through it, torchvision, transformers and scipy. On an H100
machine that was 9.1 s of the 15.3 s Lightning took to import, paid by every process of a job one link
after another: the supervisor, then rank 0, then the ranks rank 0 starts. ppo-fabric uses no torchmetrics,
and the flag gates only Lightning's `SpikeDetection`, which ppo-fabric does not use.

`skip_torchmetrics_probe` installs an import finder that refuses that one import: `torchmetrics` requested
while `lightning_fabric.utilities.imports` is executing its module body. The probe then reads it as
missing, as it would on a machine without torchmetrics. Every other import of torchmetrics, before or
after, goes through as usual. The command line installs the finder (`cli.console_main`, which every
process of a `python -m ppo_fabric` job runs) before anything imports Lightning. A program that calls
`ppo_fabric.run()` keeps Lightning's own behaviour, and so do the ranks of `fabric run`, whose
launcher has imported Lightning already.

`tests/compat/test_imports.py` fails if Lightning stops probing (the finder is then dead code, to be
removed) or probes from another module (the finder then misses it).
"""

from __future__ import annotations

import importlib.abc
import inspect
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

PROBED = "torchmetrics"
PROBING_MODULE = "lightning_fabric.utilities.imports"


class SkipTorchmetricsProbe(importlib.abc.MetaPathFinder):
    """Refuses `torchmetrics` to `PROBING_MODULE`'s module body; passes every other import on."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != PROBED or not probing():
            return None
        raise ModuleNotFoundError(f"{PROBED} left out of Lightning's import by ppo-fabric", name=fullname)


def probing() -> bool:
    """Whether `PROBING_MODULE`'s module body is on the stack (the import in progress is its probe)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == PROBING_MODULE:
            return True
        frame = frame.f_back
    return False


def skip_torchmetrics_probe() -> bool:
    """Install the finder, unless Lightning or torchmetrics is imported already (then it saves nothing).
    Returns whether it was installed."""
    if PROBING_MODULE in sys.modules or PROBED in sys.modules:
        return False
    if not any(isinstance(f, SkipTorchmetricsProbe) for f in sys.meta_path):
        sys.meta_path.insert(0, SkipTorchmetricsProbe())
    return True
