"""`algo.compile=graph`: the whole minibatch step recorded once and replayed (learn/graph.py).

The CPU runs the recorded step without a graph, so these tests prove the step's arithmetic: the same
parameters, Adam state and metrics as the eager update, bit for bit. A stand-in for torch's CUDA graph
(capturing records without running; each replay runs the step and writes into the outputs of the capture)
proves what the update does around a real graph: the captured minibatch is stepped once, each replay's
outputs are copied before the next, and the graph is kept across updates, or made anew when the optimiser's
state or the batch's columns change. The GPU proves the rest (`benchmarks/gpu_check.py` `graph_step`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.cli import main as cli_main
from ppo_fabric.config.values import ConfigError
from ppo_fabric.learn import graph as whole
from ppo_fabric.models.agent import ActorCritic
from tests.conftest import assert_cli_failure
from tests.learn.test_compile import ALGO, MODEL, masked_batch
from tests.learn.test_compile import trained as train

GRAPH = OmegaConf.merge(ALGO, {"compile": "graph"})
STEPS_PER_UPDATE = 2 * 4  # ALGO: 2 epochs of 64 / 16


def make_model() -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(gym.spaces.Box(-1, 1, (6,), np.float32), gym.spaces.Discrete(5), MODEL)


def assert_same(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> None:
    for x, y in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(x, y)
    for sx, sy in zip(a[1].state_dict()["state"].values(), b[1].state_dict()["state"].values(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sx[key], sy[key]), key
    for x, y in zip(a[2], b[2], strict=True):  # metrics, NaN (a NaN return's explained variance) as equal
        assert x.keys() == y.keys() and all(x[k] == y[k] or x[k] != x[k] and y[k] != y[k] for k in x), (x, y)


class FakeGraph:
    """torch.cuda.CUDAGraph's semantics on the CPU: capturing records the step without running it (the
    parameters and Adam state are put back as they were), and each replay runs it, writing its results into
    the tensors the capture returned."""

    replays = 0
    captures = 0

    def __init__(self) -> None:
        self.owner: whole.WholeStepGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def replay(self) -> None:
        assert self.owner is not None
        FakeGraph.replays += 1
        results = self.owner.body()
        with torch.no_grad():
            for static, new in zip(self.outputs, results, strict=True):
                static.copy_(new)


class FakeCapture:
    def __init__(self, graph: FakeGraph, owner: whole.WholeStepGraph) -> None:
        self.graph, self.owner = graph, owner

    def __enter__(self) -> None:
        FakeGraph.captures += 1
        self.graph.owner = self.owner
        tensors = [*self.owner.params, *(t for _, _, lists in self.owner.groups for s in lists for t in s)]
        self.saved = [(t, t.detach().clone()) for t in tensors]

    def __exit__(self, *exc: object) -> None:
        assert self.owner.outputs is not None
        self.graph.outputs = self.owner.outputs
        with torch.no_grad():
            for t, saved in self.saved:
                t.copy_(saved)


@pytest.fixture
def fake_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> type[FakeGraph]:
    """Every WholeStepGraph captures, with `FakeGraph` in place of CUDA's; the warm-up stream is a no-op."""
    FakeGraph.replays = FakeGraph.captures = 0
    real_init = whole.WholeStepGraph.__init__

    def init(self: whole.WholeStepGraph, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self.capture = True

    monkeypatch.setattr(whole.WholeStepGraph, "__init__", init)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: FakeCapture(g, g.pending))
    real_call = whole.WholeStepGraph.__call__

    def call(self: whole.WholeStepGraph, columns: list[Any]) -> Any:
        if self.graph is None:  # the capture context needs to know whose body it records
            graph = FakeGraph()
            graph.pending = self  # type: ignore[attr-defined]
            monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: graph)
        return real_call(self, columns)

    monkeypatch.setattr(whole.WholeStepGraph, "__call__", call)
    return FakeGraph


def test_graph_step_computes_the_eager_step() -> None:
    """On the CPU the recorded step runs directly: two updates at two learning rates, with action masks, a
    step mask, advantage normalisation and value and gradient clipping, leave the same parameters, Adam
    state and metrics as eager, bit for bit."""
    model = make_model()
    batch = masked_batch(64, 6, 5)
    eager = train(ALGO, model, [batch, batch], [3e-3, 1e-3])
    graphed = train(GRAPH, model, [batch, batch], [3e-3, 1e-3])
    moved = max(
        (p - q).abs().max().item() for p, q in zip(eager[0].parameters(), model.parameters(), strict=True)
    )
    assert moved > 1e-3, "the updates did not change the parameters: the comparison would prove nothing"
    assert_same(graphed, eager)
    kept = whole.cached(graphed[0])
    assert kept is not None and not kept.capture  # the CPU keeps the step but captures nothing


def test_a_replayed_graph_trains_like_eager(fake_cuda_graphs: type[FakeGraph]) -> None:
    """With capture and replay as CUDA has them: the first update warms up for WARMUP_STEPS eager steps,
    captures once and replays the rest (the captured minibatch stepped once, by its replay); the second
    update, at another lr, replays the same graph from its first step; every result equals eager's."""
    model = make_model()
    batch = masked_batch(64, 6, 5)
    eager = train(ALGO, model, [batch, batch], [3e-3, 1e-3])
    graphed = train(GRAPH, model, [batch, batch], [3e-3, 1e-3])
    assert_same(graphed, eager)
    assert fake_cuda_graphs.captures == 1
    assert fake_cuda_graphs.replays == 2 * STEPS_PER_UPDATE - whole.WARMUP_STEPS
    assert whole.cached(graphed[0]).lrs[0].item() == 1e-3


def test_a_new_optimiser_state_or_new_columns_make_a_new_graph(fake_cuda_graphs: type[FakeGraph]) -> None:
    """A graph reads and writes the memory it was captured with: after the optimiser's state is replaced (a
    checkpoint loaded) or when the batch gains a column (the decoupled objective's importance weights), the
    update warms up and captures again, and still trains as eager does."""
    model = make_model()
    batch = masked_batch(64, 6, 5)
    weighted = batch.clone()
    weighted["weights"] = torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.5
    batches, lrs = [batch, batch, weighted], [3e-3, 1e-3, 1e-3]
    eager = train(ALGO, model, batches, lrs, reload_at=1)
    graphed = train(GRAPH, model, batches, lrs, reload_at=1)
    assert_same(graphed, eager)
    assert fake_cuda_graphs.captures == 3
    assert fake_cuda_graphs.replays == 3 * (STEPS_PER_UPDATE - whole.WARMUP_STEPS)


def test_a_skipped_step_inside_the_graph_is_given_back(fake_cuda_graphs: type[FakeGraph]) -> None:
    """A minibatch whose loss is not finite is skipped inside the graph as on the direct path (fused Adam's
    `found_inf`), counted in train/skipped_steps, and its Adam step count given back."""
    model = make_model()
    batch = masked_batch(64, 6, 5)
    batch["returns"][5] = float("nan")  # one minibatch per epoch holds it
    eager = train(ALGO, model, [batch, batch], [3e-3, 1e-3])
    graphed = train(GRAPH, model, [batch, batch], [3e-3, 1e-3])
    assert graphed[2][1]["train/skipped_steps"] == 2
    assert_same(graphed, eager)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["algo.compile=maybe"], "algo.compile='maybe' must be false, true or graph"),
        (["algo.compile=1"], "algo.compile=1 must be false, true or graph"),
        (["model=lstm", "algo.compile=graph"], "algo.compile=graph does not support recurrent policies"),
        pytest.param(  # run() starts a child job for two processes, whose checks refuse it
            ["fabric.devices=2", "algo.compile=graph"],
            "algo.compile=graph records one rank's step",
            marks=pytest.mark.multiprocess,
        ),
        (["fabric.precision=bf16-mixed", "algo.compile=graph"], "fabric.precision=bf16-mixed: use"),
    ],
)
def test_bad_graph_settings(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    assert_cli_failure(capsys, cli_main, argv, fragment)
    with pytest.raises(ConfigError, match="algo.compile"):
        ppo_fabric.run(argv)


def test_a_graph_run_ends_where_an_eager_run_does(tmp_path: Path) -> None:
    """`algo.compile=graph` through the command line: the same seed trains CartPole to the same parameters
    as `algo.compile=false` (on the CPU the step runs uncaptured, so the runs must agree exactly)."""
    finals = {}
    for mode in ("false", "graph"):
        run_dir = tmp_path / mode
        ppo_fabric.run(
            ["algo.total_steps=1024", "logger=none", f"algo.compile={mode}", f"hydra.run.dir={run_dir}"]
        )
        finals[mode] = ppo_fabric.load_policy(run_dir).model.state_dict()
    assert finals["false"].keys() == finals["graph"].keys()
    for key, value in finals["false"].items():
        assert torch.equal(value, finals["graph"][key]), key


def test_dict_observations_go_through_the_graph(fake_cuda_graphs: type[FakeGraph], tmp_path: Path) -> None:
    """A Dict observation reaches the step as a TensorDict: its static buffer is a TensorDict of the same
    keys, filled in place before each replay. A short run with the stand-in graph ends on the eager run's
    parameters."""
    finals = {}
    for mode in ("false", "graph"):
        run_dir = tmp_path / mode
        ppo_fabric.run(
            ["env=gym", "env.id=tests.pixel_envs:DictPixels-v0", "env.num_envs=2", "algo.total_steps=128",
             "algo.rollout_steps=32", "algo.minibatch_size=16", "logger=none", f"algo.compile={mode}",
             f"hydra.run.dir={run_dir}"]
        )  # fmt: skip
        finals[mode] = ppo_fabric.load_policy(run_dir).model.state_dict()
    assert fake_cuda_graphs.captures == 1 and fake_cuda_graphs.replays > 0
    for key, value in finals["false"].items():
        assert torch.equal(value, finals["graph"][key]), key
