"""Outputs that cannot be written (a full disk): TensorBoard dropped with one warning, the files the run
writes named in the error, and no temp file or duplicated row left for the next session."""

from __future__ import annotations

import csv
import threading
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_fabric.runs.metrics import CsvMetrics, RunLogger, quiet_tensorboard_writer
from ppo_fabric.runs.metrics_file import read_rows, write_json


def _full_disk(*_: object, **__: object) -> None:
    """What Lightning's TensorBoardLogger raised when its writer could not write: a ValueError ("you tried
    to log ... which is currently not supported") from the OSError."""
    try:
        raise OSError(28, "No space left on device")
    except OSError as exc:
        raise ValueError("\n you tried to log 0.5 which is currently not supported.") from exc


def test_tensorboard_that_cannot_write_is_dropped_with_one_warning(tmp_path: Path) -> None:
    cfg = OmegaConf.create({"logger": {"tensorboard": True, "csv": True, "tracker": None}})
    run = RunLogger(tmp_path, cfg, 1_000, enabled=True)
    (board,) = run.loggers
    board.log_metrics = _full_disk
    with pytest.warns(UserWarning) as caught:
        run.log({"loss": 0.5}, 128)
        run.log({"loss": 0.25}, 256)
        run.close()
    assert [str(w.message) for w in caught] == [
        f"ppo-fabric: TensorBoard could not write its events in {tmp_path / 'tensorboard'} (OSError: [Errno 28] "
        "No space left on device); the run goes on without it (metrics.csv holds every row)"
    ]
    assert [row["step"] for row in read_rows(tmp_path / "metrics.csv")] == ["128", "256"]


def test_tensorboards_writer_thread_failing_prints_nothing_and_other_threads_still_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its writer thread keeps the error for the next write, which raises it where the run drops
    TensorBoard: the thread's own ~15-line traceback said nothing more. A test that fails when
    TensorBoard's writer thread moves out of its package (the hook tells it by its class's module)."""
    from tensorboard.summary.writer import event_file_writer

    writer_thread = next(
        v for v in vars(event_file_writer).values() if isinstance(v, type) and issubclass(v, threading.Thread)
    )
    assert writer_thread.__module__.startswith("tensorboard.")
    reached: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reached.append(args.thread.name))
    quiet_tensorboard_writer()
    quiet_tensorboard_writer()  # once per process: a second call adds nothing

    def fail() -> None:
        raise OSError(28, "No space left on device")

    class Writer(threading.Thread):
        pass

    Writer.__module__ = writer_thread.__module__
    for thread in (Writer(target=fail, name="writer"), threading.Thread(target=fail, name="users-own")):
        thread.start()
        thread.join()
    assert reached == ["users-own"]


def test_a_json_output_that_cannot_be_written_is_named_and_leaves_no_temp_file(tmp_path: Path) -> None:
    (tmp_path / "summary.json").mkdir()  # refuses the replace, as a full disk refuses the write
    with pytest.raises(OSError) as raised:
        write_json(tmp_path / "summary.json", {"a": 1})
    assert raised.value.filename == str(tmp_path / "summary.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def _rows(path: Path) -> list[str]:
    with path.open(newline="") as fh:
        return [row["step"] for row in csv.DictReader(fh)]


def test_rows_a_failed_rewrite_left_in_both_files_are_kept_once(tmp_path: Path) -> None:
    """A resume moves the rows past its checkpoint to metrics.dropped.csv, then rewrites metrics.csv; on a
    full disk the rewrite failed and the next resume moved the same rows aside again: twice in the file."""
    metrics = tmp_path / "metrics.csv"
    table = CsvMetrics(metrics)
    for step in (1, 2, 3, 4):
        table.log({"loss": float(step)}, step)
    dropped = tmp_path / "metrics.dropped.csv"
    dropped.write_text(
        metrics.read_text().split("\n", 3)[0] + "\n" + metrics.read_text().splitlines()[3] + "\n"
    )
    assert _rows(dropped) == ["3"]  # a resume at step 2 moved row 3 aside, then its rewrite failed
    CsvMetrics(metrics, resumed_at=2)
    assert _rows(metrics) == ["1", "2"]
    assert _rows(dropped) == ["3", "4"]
