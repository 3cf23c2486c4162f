"""A training step in flight under :meth:`ds_ring.engine.preemption.Preemption.step_in_flight`: what a signal does
to it.

In one process (no ranks):

- a signal mid-step abandons it at once (:class:`StepAbandoned`, the step before it completed) and leaves the
  notice its peers look for;
- a signal in the optimizer update (:meth:`Preemption.updating`) is deferred: the step completes and the
  end-of-step poll stops; an error inside the update is not turned into an abandon (the state is torn there);
- a step measured at most half the grace is finished; one that has not ended half the grace after the signal is
  abandoned then (also out of a sleep);
- an error while a peer's notice is there abandons the step (the peer that stopped is why);
- a step longer than the grace in a loop that only polls at its end is named once in a warning.

On 2 gloo ranks: a rank blocked in a wait on a peer that abandoned (alive, its notice written) gets out, and so
does a rank blocked on a silent peer that receives a signal itself.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ds_ring.config import PreemptionConfig
from ds_ring.engine.preemption import NOTICE, Preemption, StepAbandoned
from tests.dist import CaseLog, assert_no_failures, run_distributed

HANG_GUARD_S = 30.0


def _preemption(exits: list[int], **config: object) -> Preemption:
    config = {"signals": ["SIGUSR1"], "grace_s": 600, **config}
    return Preemption(PreemptionConfig(**config), exit=exits.append).install()


def _spin(seconds: float = HANG_GUARD_S) -> None:
    """Python work (signal handlers run between bytecodes) until a handler raises; a hang guard only."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.005)
    raise AssertionError(f"no StepAbandoned within {seconds} s")


def test_a_signal_mid_step_abandons_it(tmp_path: Path) -> None:
    preemption = _preemption([])
    try:
        with pytest.raises(StepAbandoned) as abandoned, preemption.step_in_flight(3, tmp_path):
            os.kill(os.getpid(), signal.SIGUSR1)
            _spin()
        assert (abandoned.value.completed, abandoned.value.step) == (2, 3)
        notice = json.loads((tmp_path / NOTICE.format(token=preemption.token)).read_text())
        assert notice["step"] == 3 and preemption.stop_requested(3)
    finally:
        preemption.close()


def test_a_signal_in_the_update_is_deferred_to_the_end_of_the_step(tmp_path: Path) -> None:
    preemption = _preemption([])
    try:
        with preemption.step_in_flight(3, tmp_path):
            with preemption.updating():
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.2)  # the handler runs here, and only records
            time.sleep(0.2)  # after the update: the step is complete, nothing to abandon
        assert preemption.signalled == "SIGUSR1" and preemption.abandoned is None
        assert preemption.stop_requested(3)
        with pytest.raises(RuntimeError, match="torn"), preemption.step_in_flight(4, tmp_path), preemption.updating():
            raise RuntimeError("torn update")
    finally:
        preemption.close()


def test_a_short_step_is_finished_and_one_past_half_the_grace_abandoned(tmp_path: Path) -> None:
    preemption = _preemption([], grace_s=2)
    try:
        with preemption.step_in_flight(1, tmp_path):
            pass  # measured: well under half the grace
        with preemption.step_in_flight(2, tmp_path):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.1)  # the handler has run: the step goes on
        assert preemption.abandoned is None and preemption.stop_requested(2)
    finally:
        preemption.close()
    preemption = _preemption([], grace_s=2)
    try:
        with preemption.step_in_flight(1, tmp_path):
            pass
        started = time.monotonic()
        with pytest.raises(StepAbandoned) as abandoned, preemption.step_in_flight(2, tmp_path):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(HANG_GUARD_S)  # one long sleep: ended by the recheck at half the grace
        assert abandoned.value.completed == 1 and 0.9 < time.monotonic() - started < HANG_GUARD_S
    finally:
        preemption.close()


def test_an_error_while_a_peer_abandons_abandons_the_step(tmp_path: Path) -> None:
    preemption = _preemption([])
    try:
        (tmp_path / NOTICE.format(token=preemption.token)).write_text(json.dumps({"step": 5, "rank": 1}))
        with pytest.raises(StepAbandoned) as abandoned, preemption.step_in_flight(5, tmp_path):
            raise RuntimeError("Connection closed by peer")
        assert abandoned.value.completed == 4 and "RuntimeError" in abandoned.value.reason
        with pytest.raises(RuntimeError, match="no peer"), preemption.step_in_flight(6, tmp_path):
            raise RuntimeError("no peer abandoned step 6")  # the notice names step 5
    finally:
        preemption.close()


def test_a_long_step_that_only_the_end_of_step_poll_covers_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    preemption = _preemption([], grace_s=0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="ds_ring.engine.preemption"):
            for step in (1, 2, 3):
                time.sleep(0.3)
                preemption.stop_requested(step)
        warnings = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "grace_s = 0.2 s" in warnings[0] and "step 2 took 0." in warnings[0]
        assert "step_in_flight" in warnings[0]
    finally:
        preemption.close()


def _blocked_rank(rank: int, world_size: int, directory: str) -> list[str]:
    import torch
    import torch.distributed as dist

    from ds_ring.comm.wait import Pending, wait_all

    log = CaseLog()
    directory = Path(directory)
    preemption = _preemption([])
    preemption.token = "run"
    with log.case("a rank blocked on a peer that abandoned (and stays alive) gets out"):
        if rank == 0:
            started = time.monotonic()
            work = dist.irecv(torch.zeros(4), src=1)
            with pytest.raises(StepAbandoned) as abandoned, preemption.step_in_flight(3, directory):
                wait_all([Pending(work, 1, "recv from rank 1")], timeout_s=120, rank=0, op="test", step=3)
            assert abandoned.value.completed == 2 and "rank 1 abandoned it" in abandoned.value.reason
            assert time.monotonic() - started < HANG_GUARD_S
            (directory / "rank0_out").touch()
        else:
            with pytest.raises(StepAbandoned), preemption.step_in_flight(3, directory):
                os.kill(os.getpid(), signal.SIGUSR1)
                _spin()
            deadline = time.monotonic() + HANG_GUARD_S
            while not (directory / "rank0_out").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # alive, sending nothing, until rank 0 is out
            assert (directory / "rank0_out").exists()
    preemption.close()
    dist.barrier()
    preemption = _preemption([])
    preemption.token = "run2"
    with log.case("a rank blocked on a silent peer that is signalled itself gets out"):
        if rank == 0:
            work = dist.irecv(torch.zeros(4), src=1)
            with pytest.raises(StepAbandoned) as abandoned, preemption.step_in_flight(7, directory):
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()  # arrives while blocked
                wait_all([Pending(work, 1, "recv from rank 1")], timeout_s=120, rank=0, op="test", step=7)
            assert abandoned.value.completed == 6
        else:
            time.sleep(2.0)  # silent: rank 0's wait is left behind (its helper thread, a daemon, ends with it)
    preemption.close()
    return log.failures


def test_a_rank_blocked_in_a_wait_gets_out(tmp_path: Path) -> None:
    assert_no_failures(run_distributed(_blocked_rank, 2, timeout=120, directory=str(tmp_path)))
