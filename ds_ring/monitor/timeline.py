"""One rank's communication and attention time, summed from hook events between two ``take()`` calls."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ds_ring.hooks import Event

__all__ = ["RankTotals", "StepTimeline", "COLLECTIVES", "MONITOR_OP_PREFIX"]

COLLECTIVES = frozenset({"all_gather", "reduce_scatter", "all_to_all", "all_reduce"})
# Communication the monitor itself does (aggregating metrics, agreeing to skip) is not counted.
MONITOR_OP_PREFIX = "monitor_"


@dataclass
class RankTotals:
    """Sums over one training step on one rank.

    attention_s: wall time inside attention calls (forward and backward), waits included.
    attention_wait_s: the part of it spent blocked waiting for communication.
    comm_s: time ds_ring's transfers were in flight (posting to completion), summed.
    comm_wait_s: the part of ``comm_s`` this rank spent blocked waiting (not hidden by compute).
    On CUDA data over NCCL (stream-ordered waits) ``comm_s`` / ``comm_wait_s`` are GPU times from CUDA events
    (post to arrival, and the compute stream's stall at the wait: :mod:`ds_ring.comm.gpu_timing`); on gloo /
    CPU data host times.
    sent_bytes, received_bytes: bytes moved by ds_ring's transfers.
    attention_calls: attention calls (forward and backward count one each).
    """

    attention_s: float = 0.0
    attention_wait_s: float = 0.0
    comm_s: float = 0.0
    comm_wait_s: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0
    attention_calls: int = 0

    @property
    def attention_compute_s(self) -> float:
        """Attention time not spent blocked on communication."""
        return max(0.0, self.attention_s - self.attention_wait_s)

    @property
    def hidden_share(self) -> float:
        """Share of communication time hidden behind compute (``nan`` without communication)."""
        if self.comm_s <= 0:
            return float("nan")
        return min(1.0, max(0.0, 1.0 - self.comm_wait_s / self.comm_s))


class StepTimeline:
    """A hook (register it for start and end events) summing the events of one rank into :class:`RankTotals`.

    Ring steps and collectives count once each (not their per-transfer ``send``/``recv`` events);
    blocked time inside an attention call is attributed to it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = RankTotals()
        self._depth = 0  # attention calls in progress
        self._deferred: list[tuple[Any, bool]] = []  # (StreamTiming, inside attention) not yet complete

    def __call__(self, event: Event) -> None:
        if event.op.startswith(MONITOR_OP_PREFIX):
            return
        with self._lock:
            totals = self._totals
            if event.kind == "attention":
                if event.phase == "start":
                    self._depth += 1
                    return
                self._depth = max(0, self._depth - 1)
                totals.attention_s += event.seconds
                totals.attention_calls += 1
            elif event.phase == "end" and (event.kind == "ring_step" or event.kind in COLLECTIVES):
                timing = event.extra.get("stream_timing")
                if timing is not None:  # stream-ordered (NCCL): GPU times, read at a take once complete
                    self._deferred.append((timing, self._depth > 0))
                else:  # gloo / CPU data: host time in flight and blocked
                    self._add_comm(totals, event.seconds, float(event.extra.get("wait_s", 0.0)), self._depth > 0)
                if event.kind == "ring_step":
                    totals.sent_bytes += event.nbytes
                    totals.received_bytes += int(event.extra.get("received_bytes", 0))
                else:
                    totals.sent_bytes += int(event.extra.get("sent_bytes", 0))
                    totals.received_bytes += event.nbytes

    @staticmethod
    def _add_comm(totals: RankTotals, seconds: float, wait_s: float, in_attention: bool) -> None:
        totals.comm_s += seconds
        totals.comm_wait_s += wait_s
        if in_attention:
            totals.attention_wait_s += wait_s

    def take(self) -> RankTotals:
        """The totals since the last call, and start new ones.

        Stream-ordered transfers (``extra["stream_timing"]``) count with their GPU times
        (``Event.elapsed_time``) in the first take after their events completed (``Event.query()``: the host
        is never synchronized); the others wait for a later take.
        """
        with self._lock:
            totals, self._totals = self._totals, RankTotals()
            deferred, self._deferred = self._deferred, []
        later = []
        for timing, in_attention in deferred:
            if timing.done():
                self._add_comm(totals, *timing.seconds(), in_attention)
            else:
                later.append((timing, in_attention))
        with self._lock:
            self._deferred = later + self._deferred
        return totals
