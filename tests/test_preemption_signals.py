"""The signal side of :class:`ds_ring.engine.preemption.Preemption`, in one process (no ranks, no launcher).

- before the loop polls, a signal keeps its old effect (the previous handler runs);
- once polled, the first signal only sets the stop (the next poll is true), a repeat within
  ``repeat_window_s`` is ignored, a later one exits with 128 + signal;
- the grace period running out exits with :data:`GRACE_EXPIRED`;
- the config refuses unknown or uncatchable signal names, naming the field.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ds_ring.config import PreemptionConfig
from ds_ring.engine.preemption import GRACE_EXPIRED, Preemption


def _preemption(exits: list[int], **config: object) -> Preemption:
    return Preemption(PreemptionConfig(**config), exit=exits.append).install()


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s  # a hang guard only
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_before_the_first_poll_a_signal_does_what_it_did() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: seen.append(number))
    try:
        preemption = _preemption([], signals=["SIGUSR1"])
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: seen)
        assert seen == [signal.SIGUSR1] and preemption.signalled is None
        assert signal.getsignal(signal.SIGUSR1) is not preemption._on_signal  # handed back
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_first_signal_stops_a_repeat_is_ignored_a_later_one_exits() -> None:
    exits: list[int] = []
    preemption = _preemption(exits, signals=["SIGUSR1"], grace_s=600, repeat_window_s=0.5)
    try:
        assert not preemption.stop_requested(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: preemption.signalled)
        assert preemption.signalled == "SIGUSR1" and 0 < preemption.seconds_left() <= 600
        os.kill(os.getpid(), signal.SIGUSR1)  # the same preemption, forwarded by a launcher
        assert preemption.stop_requested(2) and exits == []
        time.sleep(0.6)
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: exits)
        assert exits == [128 + signal.SIGUSR1]
    finally:
        preemption.close()


def test_grace_running_out_exits() -> None:
    exits: list[int] = []
    preemption = _preemption(exits, signals=["SIGUSR1"], grace_s=0.2)
    try:
        preemption.stop_requested(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: exits)
        assert exits == [GRACE_EXPIRED]
    finally:
        preemption.close()


@pytest.mark.parametrize("names", [["SIGTERN"], ["SIGKILL"], []])
def test_config_refuses_uncatchable_signals(names: list[str]) -> None:
    with pytest.raises(ValueError, match="ring_attention.preemption.signals"):
        PreemptionConfig(signals=names)
