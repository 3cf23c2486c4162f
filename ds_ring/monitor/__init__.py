"""Monitoring: built-in hooks on ds_ring's events (metrics, watchdog, numerics guard) and clean exits.

The observed layers (``comm``, ``strategies``) only emit :class:`ds_ring.hooks.Event`\\ s; this
package subscribes with :func:`ds_ring.hooks.register_hook` and never changes results. It writes
metrics through any object with DeepSpeed's ``write_events`` and does not import DeepSpeed.

- :class:`RingMonitor` (``engine.ring_monitor`` after ``ds_ring.initialize``): the hooks the
  ``ring_attention.monitoring`` section switches on, driven by ``begin_step`` / ``skip_step`` /
  ``end_step``;
- :class:`StepTimeline`, :class:`MetricsReporter`: per-step times, bytes and memory, min / max over ranks;
- :class:`Watchdog`: communication errors logged where they happen, optional step deadline;
- :class:`NumericsGuard`, :class:`NumericsError`: NaN / Inf in attention outputs or LSE;
- :func:`label_layers`: events inside an attention module carry its name;
- :class:`TensorCensus`: the tensors alive at a rank's memory peak, by the module and op that made them;
- :func:`run_main`: run a training entry point and exit 0, or non-zero after logging the error,
  after the flushes registered with :func:`at_clean_exit` (e.g. :func:`flush_writer` of W&B / Comet).
"""

from ds_ring.monitor.census import CensusPeak, TensorCensus
from ds_ring.monitor.exit import at_clean_exit, run_main
from ds_ring.monitor.flush import flush_writer
from ds_ring.monitor.guard import GUARD_MODES, NumericsError, NumericsGuard
from ds_ring.monitor.layers import label_layers
from ds_ring.monitor.metrics import METRICS, MetricsReporter
from ds_ring.monitor.ring_monitor import RingMonitor
from ds_ring.monitor.timeline import RankTotals, StepTimeline
from ds_ring.monitor.watchdog import Watchdog

__all__ = [
    "CensusPeak",
    "GUARD_MODES",
    "METRICS",
    "MetricsReporter",
    "NumericsError",
    "NumericsGuard",
    "RankTotals",
    "RingMonitor",
    "StepTimeline",
    "TensorCensus",
    "Watchdog",
    "at_clean_exit",
    "flush_writer",
    "label_layers",
    "run_main",
]
