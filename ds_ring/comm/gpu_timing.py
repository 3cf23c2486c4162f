"""GPU time of a stream-ordered transfer (CUDA data on NCCL, :func:`ds_ring.comm.wait.stream_ordered`).

There the host never blocks on a transfer (``Work.wait()`` only makes the compute stream wait), so host time
says nothing about how long the GPU was exposed to it. Instead three CUDA events are recorded on the compute
stream: ``posted`` when the transfer is posted, ``waiting`` just before the compute stream waits on it and
``arrived`` just after. ``posted → arrived`` is the time in flight as the compute stream saw it, and
``waiting → arrived`` the time the compute stream stalled on the transfer (nothing else is queued between
the two: the gap is the wait). Both are read with ``Event.elapsed_time`` only when the monitor's timeline is
taken at a step's end, and only for transfers whose events have completed (``Event.query()``, no host sync):
the rest are counted at a later take (:class:`ds_ring.monitor.timeline.StepTimeline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CudaEvents", "EVENTS", "StreamTiming", "mark"]


class CudaEvents:
    """The CUDA calls made here (tests swap in a recording fake): timing events on the current stream."""

    def new_event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)


EVENTS = CudaEvents()


def mark(device: torch.device) -> Any:
    """A timing event recorded now on ``device``'s current stream."""
    event = EVENTS.new_event()
    event.record(EVENTS.current_stream(device))
    return event


@dataclass(frozen=True)
class StreamTiming:
    """The events of one stream-ordered transfer (``extra["stream_timing"]`` of its end event)."""

    posted: Any
    waiting: Any
    arrived: Any

    def done(self) -> bool:
        """Whether the GPU has passed all three events (``Event.query()``: never blocks the host)."""
        return all(event.query() for event in (self.posted, self.waiting, self.arrived))

    def seconds(self) -> tuple[float, float]:
        """``(in flight, stalled)`` in seconds; call only once :meth:`done`."""
        return self.posted.elapsed_time(self.arrived) / 1e3, self.waiting.elapsed_time(self.arrived) / 1e3
