"""Ranks of a sequence-parallel group that load different batches are refused, not silently stitched.

4 gloo ranks as 2 data-parallel replicas × 2 sequence-parallel ranks, a dataset of distinct samples:

- a ``DistributedSampler`` over the *world* (the usual loader, wrong here): ``SequenceParallelDataLoader``
  raises one ``ValueError`` on every rank within seconds, naming ``shard_batch``, the batch's digest per
  rank and the fix (a sampler over ``get_data_parallel_world_size()`` replicas, or
  ``UlyssesSPDataLoaderAdapter``); different lengths name each rank's shapes;
- a sampler over the data-parallel replicas passes and shards as before; ``check_same=False`` skips the
  exchange; ``UlyssesSPDataLoaderAdapter`` over the world sampler runs every rank's sample whole.
"""

import re
import time

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import ds_ring
from ds_ring.integrations.hf import SequenceParallelDataLoader, UlyssesSPDataLoaderAdapter, shard_batch
from ds_ring.integrations.hf.registration import register_with_transformers
from tests.dist import CaseLog, assert_no_failures, run_distributed

SEQ = 16


def _samples(n: int = 8) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.arange(SEQ) * 10 + i, "labels": torch.arange(SEQ) * 10 + i} for i in range(n)]


def _loader(sampler_replicas: int, sampler_rank: int) -> DataLoader:
    data = _samples()
    sampler = DistributedSampler(data, num_replicas=sampler_replicas, rank=sampler_rank, shuffle=False)
    return DataLoader(data, batch_size=1, sampler=sampler)


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    topology = ds_ring.Topology(data_parallel=2, ring=2, timeout_s=20)
    section = {"strategy": "ring", "sequence_parallel_size": 2, "timeout_s": 20}
    session = register_with_transformers(config={"ring_attention": section}, topology=topology)
    try:
        with log.case("a sampler over the world: every rank raises, naming the ranks, digests and fix"):
            loader = SequenceParallelDataLoader(_loader(world, rank), session)
            started = time.monotonic()
            with pytest.raises(ValueError) as raised:
                next(iter(loader))
            assert time.monotonic() - started < 20  # raised, not waited out: under timeout_s
            message = str(raised.value)
            sp_ranks = [r for r in range(world) if r // 2 == rank // 2]
            assert "disagree on shard_batch" in message and "batch contents (blake2b)" in message, message
            assert re.search(rf"rank {sp_ranks[0]} has '[0-9a-f]{{16}}', rank {sp_ranks[1]} has", message), message
            assert "get_data_parallel_world_size()" in message and "UlyssesSPDataLoaderAdapter" in message
        with log.case("different lengths name each rank's shapes"):
            batch = {"input_ids": torch.zeros(1, SEQ if rank % 2 else 2 * SEQ, dtype=torch.long)}
            with pytest.raises(ValueError, match=r"batch shapes: rank \d has 'input_ids \[1, 32\]'"):
                shard_batch(session, batch)
        with log.case("a sampler over the data-parallel replicas passes, sharded as before"):
            replicas, replica = topology.get_data_parallel_world_size(), topology.get_data_parallel_rank()
            loader = SequenceParallelDataLoader(_loader(replicas, replica), session)
            for full, got in zip(_loader(replicas, replica), loader, strict=True):
                assert torch.equal(got["input_ids"], shard_batch(session, full, check_same=False)["input_ids"])
        with log.case("check_same=False moves nothing"):
            events = []
            with ds_ring.register_hook(events.append):
                shard_batch(session, {k: v[None] for k, v in _samples()[rank].items()}, check_same=False)
            assert not events, events
        with log.case("UlyssesSPDataLoaderAdapter over the world sampler runs every rank's sample whole"):
            adapter = UlyssesSPDataLoaderAdapter(
                _loader(world, rank), sp_rank=topology.get_sequence_parallel_rank(),
                sp_group=topology.sequence_parallel_group, sp_world_size=2, device="cpu", session=session,
            )  # fmt: skip
            first, second = list(adapter)[:2]
            group_first = rank - rank % 2  # the sample of sequence-parallel rank 0 runs first, then rank 1's
            half = slice(0, SEQ // 2) if rank % 2 == 0 else slice(SEQ // 2, SEQ)
            assert torch.equal(first["input_ids"][0], _samples()[group_first]["input_ids"][half])
            assert torch.equal(second["input_ids"][0], _samples()[group_first + 1]["input_ids"][half])
    finally:
        session.close()
    return log.failures


@pytest.mark.timeout(120)
def test_different_batches_in_a_group_are_refused():
    assert_no_failures(run_distributed(_rank, 4, timeout=90))
