"""ZeRO 3's blocking gathers hold every parameter when they return (:mod:`ds_ring.engine.zero_gathers`).

On 2 gloo ranks, a small model at ZeRO 3, every all-gather DeepSpeed launches as a blocking gather of several
parameters is watched: by the time the call returns, each one's handle has been waited on, for the
re-gather of the persistent parameters at the end of an optimizer step and for ``GatheredParameters`` over
several parameters (what ``ds_ring.tiles.zero.gathered`` runs). On a DeepSpeed before 0.19.8 the same step
without :func:`~ds_ring.engine.zero_gathers.wait_for_every_gather` leaves handles unwaited: the check sees the defect it
guards against (with ``ds_ring.initialize`` it is installed, and the whole training run is checked by
``test_zero_equivalence.py`` and ``test_hf_trainer.py``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.dist import CaseLog, assert_no_failures, run_distributed

WIDTH = 8


class _Watched:
    """An async collective's handle that reports when it is waited on."""

    def __init__(self, work: Any, pending: dict[int, _Watched]) -> None:
        self._work, self._pending = work, pending
        pending[id(self)] = self  # held until waited on

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._pending.pop(id(self), None)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _watch_gathers(pending: dict[int, _Watched]) -> None:
    """Every async all-gather ZeRO's partitioning code launches (``deepspeed.comm``) returns a watched handle."""
    from deepspeed import comm

    def watched(launch):
        def call(*args: Any, **kwargs: Any) -> Any:
            work = launch(*args, **kwargs)
            return _Watched(work, pending) if kwargs.get("async_op") and work is not None else work

        return call

    comm.all_gather_into_tensor = watched(comm.all_gather_into_tensor)
    comm.all_gather = watched(comm.all_gather)


def _engine(persistence_threshold: int | None):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 1))
    zero: dict[str, Any] = {"stage": 3}
    if persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return engine


def _step(engine) -> None:
    engine.backward(engine(torch.ones(1, WIDTH)).sum())
    engine.step()


def _rank(rank: int, world: int) -> list[str]:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from ds_ring.engine.zero_gathers import wait_for_every_gather, waits_for_every_gather

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    deepspeed.init_distributed(dist_backend="gloo")
    log = CaseLog()
    pending: dict[int, _Watched] = {}
    _watch_gathers(pending)
    persistent = _engine(None)  # every parameter below the persistence threshold: re-gathered after each step
    if not waits_for_every_gather():
        with log.case(f"DeepSpeed {deepspeed.__version__} alone leaves a step's persistent gathers unwaited"):
            _step(persistent)
            assert pending, "every handle was waited on: the watch no longer sees the defect"
        for work in list(pending.values()):  # what DeepSpeed left, before the next collective
            work.wait()
    wait_for_every_gather()
    with log.case("an optimizer step's re-gather of 6 persistent parameters: every handle waited"):
        _step(persistent)
        assert not pending, f"{len(pending)} all-gathers still unwaited when engine.step() returned"
    persistent.destroy()
    partitioned = _engine(0)  # none persistent: GatheredParameters gathers them all
    with log.case("GatheredParameters over 6 partitioned parameters: every handle waited, the values whole"):
        params = list(partitioned.module.parameters())
        with GatheredParameters(params):
            assert not pending, f"{len(pending)} all-gathers still unwaited inside GatheredParameters"
            shapes = [tuple(p.shape) for p in params]
            total = sum(p.numel() for p in params)
        assert shapes == [(WIDTH, WIDTH), (WIDTH,), (WIDTH,), (WIDTH,), (1, WIDTH), (1,)], shapes
        assert total == WIDTH * WIDTH + 3 * WIDTH + WIDTH + 1
    partitioned.destroy()
    return log.failures


@pytest.mark.timeout(180)
def test_blocking_zero3_gathers_wait_for_every_parameter() -> None:
    assert_no_failures(run_distributed(_rank, 2, timeout=150))
