"""NaN injected into one rank's input: each ``numerics_guard`` mode does what the ds_config says.

Two sequence-parallel ranks train a one-attention model (causal ring attention, so the NaN in
rank 1's shard reaches rank 1's output only) through ``ds_ring.initialize``; step 2 carries the
NaN. ``off``: nothing is said and the NaN reaches the parameters; ``warn``: rank 1 warns naming
its layer, rank and step, training goes on; ``raise``: rank 1's forward raises ``NumericsError``
naming them; ``skip_step``: rank 1 warns, *both* ranks skip the update (parameters unchanged) and
the next step trains normally. The guard never changes results: step 1's output is bit-equal in
every mode.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

import ds_ring
from ds_ring.monitor import NumericsError
from ds_ring.monitor.guard import nonfinite_report
from tests.dist import CaseLog, run_distributed

SEQ, DIM, LAYER = 16, 16, "attn.attention"


class _OneAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.attn = ds_ring.MultiheadRingDilatedAttention(DIM, 4, causal=True)
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(self.inp(x))[0])


def _config(mode: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "ring_attention": {"strategy": "ring", "sequence_parallel_size": 2, "causal": True, "timeout_s": 30,
                           "monitoring": {"numerics_guard": mode}},
    }  # fmt: skip


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train(rank: int, mode: str) -> dict:
    """Steps 1-3 (1-2 for ``raise``); step 2 has a NaN in rank 1's input."""
    torch.manual_seed(0)
    model = _OneAttention()
    engine, *_ = ds_ring.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    config=_config(mode), seq_len=SEQ)  # fmt: skip
    monitor, group = engine.ring_monitor, engine.mpu.sequence_parallel_group
    records = _Records()
    logging.getLogger("ds_ring.monitor").addHandler(records)
    result: dict = {"skipped": [], "params": [], "raised": None, "outputs": []}
    try:
        for step in (1, 2, 3):
            monitor.begin_step(step)
            x = ds_ring.shard_sequence(torch.randn(1, SEQ, 8, generator=torch.Generator().manual_seed(step)), group)
            if step == 2 and rank == 1:
                x[0, 3, :] = float("nan")
            try:
                y = engine(x)
            except NumericsError as err:
                result["raised"] = str(err)
            result["outputs"].append(y.detach().clone())
            if mode == "raise" and step == 2:  # rank 1 raised: the ranks part here
                break
            skipped = monitor.skip_step()
            if not skipped:
                engine.backward(y.sum())
                engine.step()
            monitor.end_step()
            result["skipped"].append(skipped)
            result["params"].append([p.detach().clone() for p in engine.module.parameters()])
    finally:
        logging.getLogger("ds_ring.monitor").removeHandler(records)
        engine.destroy()
    result["warnings"] = records.messages
    return result


def _rank(rank: int, world: int) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    log = CaseLog()
    runs = {mode: _train(rank, mode) for mode in ("off", "warn", "raise", "skip_step")}
    named = f"ds_ring numerics guard: rank 1, layer {LAYER}, training step 2: attention output holds "

    def finite(params: list[torch.Tensor]) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in params)

    with log.case("the guard never changes results: step 1 is bit-equal in every mode"):
        for mode, run in runs.items():
            torch.testing.assert_close(run["outputs"][0], runs["off"]["outputs"][0], rtol=0, atol=0, msg=mode)
    with log.case("off: silent, the NaN reaches the parameters"):
        run = runs["off"]
        assert run["warnings"] == [] and run["raised"] is None and run["skipped"] == [False] * 3
        assert finite(run["params"][0]) and not finite(run["params"][1])
    with log.case("warn: rank 1 warns naming layer, rank and step; training goes on"):
        run = runs["warn"]
        assert run["raised"] is None and run["skipped"] == [False] * 3
        step2 = [m for m in run["warnings"] if "training step 2" in m]
        if rank == 1:
            assert len(step2) == 1 and step2[0].startswith(named) and step2[0].endswith("training goes on"), step2
        else:
            assert step2 == [], step2  # causal: the NaN is in rank 1's (later) shard only
        assert not finite(run["params"][1])
    with log.case("raise: rank 1's forward raises NumericsError naming layer, rank and step"):
        run = runs["raise"]
        if rank == 1:
            assert run["raised"] is not None and run["raised"].startswith(named), run["raised"]
        else:
            assert run["raised"] is None
        assert run["warnings"] == [] and finite(run["params"][0])
    with log.case("skip_step: rank 1 warns, both ranks skip step 2, step 3 trains"):
        run = runs["skip_step"]
        assert run["raised"] is None and run["skipped"] == [False, True, False], run["skipped"]
        step2 = [m for m in run["warnings"] if "training step 2" in m]
        assert any(m.startswith(f"ds_ring numerics guard: rank {rank} skips training step 2 (non-finite "
                                f"attention on rank(s) [1])") for m in step2), step2  # fmt: skip
        if rank == 1:
            assert any(m.startswith(named) and m.endswith("skipped on every rank") for m in step2), step2
        after1, after2, after3 = run["params"]
        assert all(torch.equal(a, b) for a, b in zip(after1, after2, strict=True)), "step 2 changed the parameters"
        assert finite(after3) and not all(torch.equal(a, b) for a, b in zip(after2, after3, strict=True))
    return {"failures": log.failures}


@pytest.mark.timeout(120)
def test_each_guard_mode_behaves_as_configured() -> None:
    results = run_distributed(_rank, 2, timeout=100)
    failures = [f for result in results for f in result["failures"]]
    assert not failures, "\n".join(failures[:3])


def test_nonfinite_report_flags_nan_and_inf_but_not_uncovered_rows() -> None:
    out, lse = torch.zeros(2, 3), torch.zeros(2, 3)
    assert nonfinite_report(out, lse) is None
    lse[0, 1] = float("-inf")  # a row no key covers: output 0, not a fault
    assert nonfinite_report(out, lse) is None
    lse[1, 2] = float("inf")
    assert nonfinite_report(out, lse) == (
        "attention output holds 0 NaN and 0 Inf of 6 values, LSE 0 NaN and 1 +Inf of 6"
    )
    out[0, 0], out[1, 1] = float("nan"), float("-inf")
    lse[1, 2] = float("nan")
    assert nonfinite_report(out, lse) == (
        "attention output holds 1 NaN and 1 Inf of 6 values, LSE 1 NaN and 0 +Inf of 6"
    )
