"""ZeRO 0-3 with ds_ring sequence parallelism trains exactly like one process on the full batch.

World size 4, as 4 sequence-parallel ranks and as 2 data × 2 sequence-parallel ranks: a few SGD
steps of a small model through ``ds_ring.initialize`` give the same parameters (fp32) as one
process training the same model on the full sequences and the full batch. The same model handed to
``deepspeed.initialize(mpu=topology)`` at ZeRO 3 (whose reduce-scatter divides by every rank) refuses at
its first forward, naming ``ds_ring.initialize`` (the Hugging Face path scales its loss instead).
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import ds_ring
from ds_ring.tiles.zero import gathered
from launch.model import TinyGPT
from tests.dist import CaseLog, run_distributed

SEQ, VOCAB, BATCH, STEPS = 32, 11, 2, 3


def _config(stage: int, sequence_parallel: int, micro_batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "ring_attention": {
            "strategy": "ring",
            "sequence_parallel_size": sequence_parallel,
            "segment_lengths": [4, SEQ],
            "dilation_rates": [1, 2],
            "causal": True,
        },
    }


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, 16, 4, 2, SEQ, kv_heads=2, segment_lengths=[4, SEQ], dilation_rates=[1, 2])


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD, not Adam: the key-projection bias has an exactly-zero true gradient (softmax ignores a
    # per-query constant), and Adam's m/sqrt(v) would blow its rounding noise up to lr-sized steps.
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    return tokens, labels


def _full_batch_parameters(single: ds_ring.Topology) -> list[torch.Tensor]:
    model = _model()
    for module in model.modules():
        if isinstance(module, ds_ring.RingDilatedAttention):
            module.configure(topology=single)
    optimizer = _optimizer(model)
    tokens, labels = _data()
    for _ in range(STEPS):
        loss = F.cross_entropy(model(tokens, torch.arange(SEQ)).flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _rank(rank: int, world: int, sequence_parallel: int, stages: list[int]) -> list[str]:
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    log = CaseLog()
    expected = _full_batch_parameters(ds_ring.Topology(data_parallel=world))
    tokens, labels = _data()
    data_parallel = world // sequence_parallel
    per_replica = BATCH // data_parallel
    for stage in stages:
        with log.case(f"zero stage {stage}, {data_parallel} data x {sequence_parallel} sequence"):
            model = _model()
            engine, *_ = ds_ring.initialize(
                model=model,
                config=_config(stage, sequence_parallel, per_replica),
                optimizer=_optimizer(model),
                seq_len=SEQ,
            )
            topology = engine.mpu
            group = topology.sequence_parallel_group
            rows = slice(
                topology.get_data_parallel_rank() * per_replica, (topology.get_data_parallel_rank() + 1) * per_replica
            )
            local_tokens, local_labels = (ds_ring.shard_sequence(x[rows], group) for x in (tokens, labels))
            positions = ds_ring.shard_sequence(torch.arange(SEQ), group, dim=0)
            for _ in range(STEPS):
                loss = ds_ring.sequence_parallel_cross_entropy(engine(local_tokens, positions), local_labels, group)
                engine.backward(loss)
                engine.step()
            params = list(engine.module.parameters())
            with gathered(params):
                got = [copy.deepcopy(p.detach()) for p in params]
            for (name, _), g, e in zip(engine.module.named_parameters(), got, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            engine.destroy()
    with log.case("deepspeed.initialize(mpu=topology) at ZeRO 3: the first forward refuses, naming ds_ring.initialize"):
        from ds_ring.engine.initialize import install

        config = _config(3, sequence_parallel, per_replica)
        section = ds_ring.load_config(config)
        topology = ds_ring.Topology.from_config(section, world)
        model = _model()
        install(model, section, topology)
        deepspeed_config = {k: v for k, v in config.items() if k != "ring_attention"}
        engine, *_ = deepspeed.initialize(
            model=model, config=deepspeed_config, optimizer=_optimizer(model), mpu=topology
        )
        local = ds_ring.shard_sequence(tokens[:per_replica], topology)
        with pytest.raises(ValueError, match="build the engine with ds_ring.initialize"):
            engine(local, ds_ring.shard_sequence(torch.arange(SEQ), topology, dim=0))
        engine.destroy()
    return log.failures


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sequence_parallel", [4, 2], ids=["4seq", "2data_x_2seq"])
def test_zero_stages_match_full_batch_training(sequence_parallel):
    results = run_distributed(_rank, 4, timeout=360, sequence_parallel=sequence_parallel, stages=[0, 1, 2, 3])
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:2])
