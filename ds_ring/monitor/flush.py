"""Flush the monitor backends that buffer (DeepSpeed's ``engine.monitor``) before the process ends.

:func:`ds_ring.monitor.run_main` ends the process with ``os._exit``, which skips ``atexit``
handlers and finalizers: W&B would lose the run's tail (``wandb.finish`` never called), Comet its
unsent metrics (``Experiment.end``), TensorBoard whatever its writer still holds. So
:func:`ds_ring.initialize` registers :func:`flush_writer` of the engine's monitor with
:func:`ds_ring.monitor.exit.at_clean_exit`. The CSV monitor writes each event as it comes.
Duck-typed on DeepSpeed's ``MonitorMaster`` (``tb_monitor``, ``wandb_monitor``, ``comet_monitor``):
this package does not import DeepSpeed.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["flush_writer"]


def flush_writer(writer: Any) -> list[str]:
    """Flush and close every buffering backend of DeepSpeed's monitor ``writer``; returns their names.

    Only rank 0 has backends (DeepSpeed creates them there); elsewhere this does nothing.
    """
    flushed = []
    summary = getattr(getattr(writer, "tb_monitor", None), "summary_writer", None)
    if summary is not None:
        summary.flush()
        summary.close()
        flushed.append("tensorboard")
    wandb = sys.modules.get("wandb")  # imported by DeepSpeed's WandbMonitor, which keeps no run object
    if getattr(writer, "wandb_monitor", None) is not None and wandb is not None and wandb.run is not None:
        wandb.finish()
        flushed.append("wandb")
    experiment = getattr(getattr(writer, "comet_monitor", None), "experiment", None)
    if experiment is not None:
        experiment.end()
        flushed.append("comet")
    return flushed
