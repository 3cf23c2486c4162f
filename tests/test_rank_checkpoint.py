"""A checkpoint written rank by rank with no collective (:func:`ds_ring.save_rank_checkpoint`), after a preemption
abandoned the step in flight mid-forward, resumes exactly like the collective save of the same step, at ZeRO 0-3.

On 2 gloo ranks (2 sequence-parallel), per ZeRO stage: 2 AdamW steps, then ``ds_ring.save_checkpoint`` of step 2;
step 3 runs in ``engine.preemption.step_in_flight`` and a SIGUSR1 in the first layer's forward abandons it
(under ZeRO 3 with parameters still gathered); each rank writes its part of step 2 into another directory,
published when both parts are there. Fresh engines load each checkpoint with ``ds_ring.load_checkpoint`` and take
step 3: their parameters must be bit-equal (the same model, optimizer state and step count were saved).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import ds_ring
from ds_ring.tiles.zero import gathered
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.test_zero_equivalence import SEQ, VOCAB
from tests.test_zero_equivalence import _config as zero_config
from tests.test_zero_equivalence import _model as tiny_model

pytestmark = pytest.mark.slow  # about 70 s on 2 shared cores: 12 engines
BATCH = 2


def _config(stage: int) -> dict:
    """test_zero_equivalence's ds_config (2 sequence ranks) with SIGUSR1 preemption and a grace no step reaches."""
    config = zero_config(stage, 2, BATCH)
    config["ring_attention"]["preemption"] = {"signals": ["SIGUSR1"], "grace_s": 600}
    return config


def _engine(stage: int):
    torch.manual_seed(0)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = ds_ring.initialize(model=model, config=_config(stage), optimizer=optimizer, seq_len=SEQ)
    return engine


def _step(engine, step: int) -> None:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    labels = torch.roll(tokens, -1, dims=1)
    group = engine.mpu.sequence_parallel_group
    local_tokens, local_labels = (ds_ring.shard_sequence(x, group) for x in (tokens, labels))
    positions = ds_ring.shard_sequence(torch.arange(SEQ), group, dim=0)
    loss = ds_ring.sequence_parallel_cross_entropy(engine(local_tokens, positions), local_labels, group)
    engine.backward(loss)
    engine.step()


def _parameters(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with gathered(params):
        return [p.detach().clone() for p in params]


def _signal_in_forward(module, inputs) -> None:
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(60)  # ended by the handler's StepAbandoned


def _rank(rank: int, world: int, directory: str, stages: list[int]) -> list[str]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    log = CaseLog()
    for stage in stages:
        with log.case(f"ZeRO {stage}"):
            collective, parts = Path(directory) / f"zero{stage}_collective", Path(directory) / f"zero{stage}_parts"
            engine = _engine(stage)
            for step in (1, 2):
                _step(engine, step)
            ds_ring.save_checkpoint(engine, collective, "step2", {"step": 2})
            hook = next(iter(engine.module.children())).register_forward_pre_hook(_signal_in_forward)
            with pytest.raises(ds_ring.StepAbandoned) as abandoned, engine.preemption.step_in_flight(3, parts):
                _step(engine, 3)
            hook.remove()
            assert abandoned.value.completed == 2
            ds_ring.save_rank_checkpoint(engine, parts, "step2", {"step": 2}, token=engine.preemption.token)
            engine.destroy()
            torch.distributed.barrier()  # the test's own: both parts are written
            assert (parts / "latest").read_text() == "step2"
            after = []
            for source in (collective, parts):
                resumed = _engine(stage)
                assert ds_ring.load_checkpoint(resumed, source).client_state["step"] == 2
                _step(resumed, 3)
                after.append(_parameters(resumed))
                resumed.destroy()
            for a, b in zip(*after, strict=True):
                assert torch.equal(a, b), "the rank-by-rank checkpoint resumes unlike the collective one"
    return log.failures


@pytest.mark.timeout(600)
def test_a_checkpoint_written_rank_by_rank_resumes_like_the_collective_one(tmp_path: Path) -> None:
    assert_no_failures(run_distributed(_rank, 2, timeout=500, directory=str(tmp_path), stages=[0, 1, 2, 3]))
