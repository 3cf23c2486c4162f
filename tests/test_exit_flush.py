"""Monitor backends that buffer are flushed before run_main ends the process with os._exit.

A child process (this file run as a script) writes events into fake buffering backends shaped like
DeepSpeed's ``MonitorMaster`` (TensorBoard's writer, W&B's module-level run, a Comet experiment),
registers ``flush_writer`` of it with ``at_clean_exit``, and ends through ``run_main``: after
success, after an error, and with a second flush that never returns (bounded: the process still
exits). The events must be on disk afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


class _Sink:
    """A backend that keeps events in memory until flushed (to ``<out>/<name>.json``)."""

    def __init__(self, out: Path, name: str) -> None:
        self.path, self.pending = out / f"{name}.json", []

    def log(self, *event: object) -> None:
        self.pending.append(list(event))

    def flush(self, *_: object) -> None:
        self.path.write_text(json.dumps(self.pending))


def _child(out: Path, mode: str) -> None:
    from ds_ring.monitor import at_clean_exit, flush_writer, run_main

    tensorboard, wandb_run, comet = _Sink(out, "tensorboard"), _Sink(out, "wandb"), _Sink(out, "comet")
    summary_writer = SimpleNamespace(add_scalar=tensorboard.log, flush=tensorboard.flush, close=lambda: None)
    sys.modules["wandb"] = types.ModuleType("wandb")
    sys.modules["wandb"].run, sys.modules["wandb"].finish = wandb_run, wandb_run.flush
    experiment = SimpleNamespace(log_metric=comet.log, end=comet.flush)
    master = SimpleNamespace(tb_monitor=SimpleNamespace(summary_writer=summary_writer), wandb_monitor=SimpleNamespace(),
                             csv_monitor=None, comet_monitor=SimpleNamespace(experiment=experiment))  # fmt: skip
    at_clean_exit(lambda: flush_writer(master))
    if mode == "stuck":
        at_clean_exit(lambda: time.sleep(3600))

    def main() -> None:
        for step in (1, 2):
            summary_writer.add_scalar("ds_ring/loss", 1.0 / step, step)
            wandb_run.log("ds_ring/loss", 1.0 / step, step)
            experiment.log_metric("ds_ring/loss", 1.0 / step, step)
        if mode == "error":
            raise RuntimeError("training failed")

    run_main(main, flush_timeout_s=2.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "code"), [("success", 0), ("error", 1), ("stuck", 0)])
def test_buffered_monitor_events_reach_disk_before_the_process_ends(mode: str, code: int, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, __file__, str(tmp_path), mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=90)  # fmt: skip
    assert done.returncode == code, done.stderr[-3000:]
    for backend in ("tensorboard", "wandb", "comet"):
        events = json.loads((tmp_path / f"{backend}.json").read_text())
        assert events == [["ds_ring/loss", 1.0, 1], ["ds_ring/loss", 0.5, 2]], (backend, events)
    if mode == "stuck":
        assert "flush still running after 2.0 s; exiting without it" in done.stderr, done.stderr[-3000:]


def test_initialize_registers_the_engine_monitor_flush(tmp_path: Path) -> None:
    from ds_ring.config import MonitoringConfig
    from ds_ring.engine import initialize as glue
    from ds_ring.monitor import exit as clean_exit

    sink = _Sink(tmp_path, "tensorboard")
    writer = SimpleNamespace(add_scalar=sink.log, flush=sink.flush, close=lambda: None)
    engine = SimpleNamespace(monitor=SimpleNamespace(tb_monitor=SimpleNamespace(summary_writer=writer)))
    monitor = glue.attach_monitor(engine, types.SimpleNamespace(), MonitoringConfig(watchdog=False))
    try:
        assert engine.ring_monitor is monitor and glue.attachments_of(engine).monitor is monitor
        writer.add_scalar("ds_ring/loss", 2.0, 7)
        clean_exit._run_flushes(10.0)
        assert json.loads(sink.path.read_text()) == [["ds_ring/loss", 2.0, 7]]
    finally:
        glue.attachments_of(engine).close()  # the monitor and its exit flush: state of this engine, not the module
    assert glue.attachments_of(engine).monitor is None


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _child(Path(sys.argv[1]), sys.argv[2])
