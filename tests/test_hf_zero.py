"""A Hugging Face model trained through ``ds_ring.initialize`` + ``ds_ring.integrations.hf`` = one process.

2 gloo ranks, one sequence-parallel group (ring, dense), fp32: 3 SGD steps with ZeRO 0, 2 and 3
give the parameters one process gets training the whole model on the full sequences — also in ALST's
order (register first, then ``deepspeed.initialize(mpu=topology)``) at ZeRO 2 and at ZeRO 3 on both of its
reduction paths, where the parameters are partitioned over both ranks and the replicas agree bit for bit.
With ``"bf16": {"enabled": true}`` at ZeRO 3 the model computes in bf16 (logits bf16, loss within bf16's
precision of fp32's). With ``model.gradient_checkpointing_enable()`` (attention recomputed in the
backward, communication included) the gradients summed over the group are the whole model's, float64.
"""

import copy
import os

import pytest
import torch

import ds_ring
from ds_ring.integrations.hf import (
    causal_lm_loss,
    register_with_transformers,
    shard_batch,
)
from ds_ring.tiles.zero import gathered
from tests.dist import CaseLog, run_distributed
from tests.hf_cases import (
    BATCH,
    assert_same,
    full_batch,
    llama,
    one_process_parameters,
    sequence_parallel,
    sgd,
    whole_model,
)

STEPS = 3


def _config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at norm 1.0 unless told otherwise
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "ring_attention": {"strategy": "ring", "timeout_s": 60},
    }


def _train(stage: int, batch: dict, *, alst_order: bool = False, **zero) -> tuple[list[torch.Tensor], bool]:
    """``ds_ring.initialize`` then register with its mpu; or (``alst_order``) as ALST users do: register
    first, then ``deepspeed.initialize(mpu=topology)`` with the same ds_config. Returns the parameters and
    whether ZeRO-3 partitioned them (each rank holding part of every large one)."""
    import deepspeed

    model = llama(torch.float32)
    config = _config(stage, **zero)
    if alst_order:
        session = register_with_transformers(model, config=config)
        topology = session.topology
        engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=sgd(model), mpu=topology)
    else:
        engine, *_ = ds_ring.initialize(model=model, config=config, optimizer=sgd(model))
        session = register_with_transformers(model, config=config, topology=engine.mpu)
        topology = session.topology
    try:
        sharded = shard_batch(session, batch)
        inputs = {k: v for k, v in sharded.items() if k != "shift_labels"}
        for _ in range(STEPS):
            loss = causal_lm_loss(session, engine(**inputs).logits, sharded["shift_labels"])
            engine.backward(loss)
            engine.step()
    finally:
        session.close()
    params = list(engine.module.parameters())
    large = [p for p in params if getattr(p, "ds_numel", 0) >= 4096]
    partitioned = bool(large) and all(p.ds_tensor.numel() < p.ds_numel for p in large)
    with gathered(params):
        got = [copy.deepcopy(p.detach()) for p in params]
    engine.destroy()
    return got, partitioned


def _replicas_agree(params: list[torch.Tensor]) -> None:
    """Every rank holds bit-identical parameters."""
    flat = torch.cat([p.flatten() for p in params])
    replicas = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(replicas, flat)
    assert all(torch.equal(g, replicas[0]) for g in replicas), "the replicas differ"


def _half_step(batch: dict, stage: int, precision: str) -> tuple[torch.dtype, float, float]:
    """One forward through ds_ring.initialize with ``precision`` ("bf16" / "fp16") enabled at ``stage``:
    the logits' dtype, the loss, and fp32's loss."""
    reference = whole_model(llama(torch.float32), batch).loss.item()
    model = llama(torch.float32)
    config = {**_config(stage), precision: {"enabled": True}}
    engine, *_ = ds_ring.initialize(model=model, config=config, optimizer=sgd(model))
    session = register_with_transformers(model, config=config, topology=engine.mpu)
    try:
        sharded = shard_batch(session, batch)
        logits = engine(**{k: v for k, v in sharded.items() if k != "shift_labels"}).logits
        loss = causal_lm_loss(session, logits, sharded["shift_labels"]).item()
    finally:
        session.close()
    engine.destroy()
    return logits.dtype, loss, reference


def _rank(rank: int, world: int, stages: list[int]) -> list[str]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    log = CaseLog()
    batch = full_batch()
    names = [name for name, _ in llama(torch.float32).named_parameters()]
    expected = one_process_parameters(batch, STEPS)
    runs = [(f"zero stage {stage}", stage, False, {}) for stage in stages] + [
        ("ALST order, zero stage 2", 2, True, {}),
        ("ALST order, zero stage 3 (reduce-scatter, DeepSpeed's default)", 3, True, {}),
        ("ALST order, zero stage 3, reduce_scatter false", 3, True, {"reduce_scatter": False}),
    ]
    for case, stage, alst_order, zero in runs:
        with log.case(case):
            got, partitioned = _train(stage, batch, alst_order=alst_order, **zero)
            for name, param, want in zip(names, got, expected, strict=True):
                torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            _replicas_agree(got)
            assert partitioned == (stage == 3), f"partitioned: {partitioned}"
    from deepspeed.accelerator import get_accelerator

    halves = {"bf16": torch.bfloat16} | ({"fp16": torch.float16} if get_accelerator().is_fp16_supported() else {})
    for precision, dtype in halves.items():  # fp16: only where the accelerator runs it (not this CPU)
        for stage in stages:
            with log.case(f"{precision} at ZeRO {stage}: the model computes in {precision}"):
                got, loss, reference = _half_step(batch, stage, precision)
                assert got == dtype, got
                assert abs(loss - reference) < 0.02 * abs(reference), (loss, reference)
    with log.case("gradient checkpointing"):
        model = llama()
        reference = whole_model(model, batch)
        model.gradient_checkpointing_enable()
        model.train()
        topology = ds_ring.Topology(ring=world)
        session = register_with_transformers(model, config=_config(0), topology=topology)
        try:
            got = sequence_parallel(model, batch, session)
        finally:
            session.close()
        assert_same(got, reference)
    return log.failures


@pytest.mark.timeout(240)
def test_zero_stages_and_checkpointing_match_one_process():
    results = run_distributed(_rank, 2, timeout=200, stages=[0, 2, 3])
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures; first:\n" + "\n".join(failures[:2])
