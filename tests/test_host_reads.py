"""A prepared call reads no tensor value on the host: on a GPU, no device sync between layers.

ds_ring's own code's reads of tensor values are counted by wrapping ``Tensor.item``, ``tolist``,
``__bool__`` and ``nonzero`` (a call counts when the caller's frame is in the ``ds_ring`` package). On 4
gloo ranks, the second identical forward+backward of every strategy — ring (contiguous and zigzag),
all-gather, Ulysses, hybrid 2 × 2, dilated ring — with and without packed documents given as Python
ints makes **0** reads; so does a forward+backward of a 2-layer Hugging Face Llama on a packed batch from
``shard_batch``. The first call's count (validation, agreement, planning) is printed.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import ds_ring
from tests.dist import CaseLog, run_distributed

_PACKAGE = str(Path(ds_ring.__file__).parent)
_READS = ("item", "tolist", "__bool__", "nonzero")


@contextmanager
def counting_host_reads(counts: Counter):
    """Count reads of tensor values by ds_ring's code into ``counts`` (key: the read and the line)."""
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name, original):
        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(_PACKAGE):
                counts[f"{name} in {Path(caller.co_filename).name}:{caller.co_name}"] += 1
            return original(tensor, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _fwd_bwd(call, seq: int, heads: int = 4, kv_heads: int = 2) -> None:
    q = torch.randn(1, seq, heads, 8, requires_grad=True)
    k, v = (torch.randn(1, seq, kv_heads, 8, requires_grad=True) for _ in range(2))
    call(q, k, v).sum().backward()


CASES = {
    "ring": dict(strategy="ring"),
    "ring zigzag": dict(strategy="ring", layout="zigzag", causal=True),
    "allgather": dict(strategy="allgather"),
    "ulysses": dict(strategy="ulysses"),
    "hybrid 2x2": dict(strategy="hybrid"),
    "dilated ring": dict(strategy="ring", segment_lengths=[16, 64], dilation_rates=[1, 2], causal=True),
}


def _attention_rank(rank: int, world: int) -> tuple[list[str], dict[str, int]]:
    log, first = CaseLog(), {}
    topologies = {"hybrid 2x2": ds_ring.Topology(ulysses=2, ring=2)}
    flat = ds_ring.Topology(ring=world)
    seq = 16  # per rank
    for name, options in CASES.items():
        for documents in (None, (0, 20, 21, 48, 64)):
            if documents is not None and options.get("layout") == "zigzag":
                documents = (0, 24, 64)
            label = f"{name}{' packed' if documents else ''}"
            with log.case(label):
                call = functools.partial(
                    ds_ring.sequence_parallel_attention, topology=topologies.get(name, flat), cu_seqlens=documents,
                    **options,
                )  # fmt: skip
                counts: Counter = Counter()
                with counting_host_reads(counts):
                    _fwd_bwd(call, seq)
                first[label] = sum(counts.values())
                counts.clear()
                with counting_host_reads(counts):
                    _fwd_bwd(call, seq)
                assert not counts, dict(counts)
    return log.failures, first


def _hf_rank(rank: int, world: int) -> tuple[list[str], dict[str, int]]:
    from ds_ring.integrations.hf import register_with_transformers, shard_batch
    from tests.hf_cases import full_batch, llama

    log, first = CaseLog(), {}
    topology = ds_ring.Topology(ring=world)
    model = llama()
    positions = torch.cat([torch.arange(11), torch.arange(9), torch.arange(12)])[None]
    session = register_with_transformers(model, config={"ring_attention": {"strategy": "ring"}}, topology=topology)
    try:
        with log.case("HF Llama, 2 layers, packed batch from shard_batch"):
            batch = shard_batch(session, {**full_batch(), "position_ids": positions})
            inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
            for attempt in ("first", "second"):
                counts: Counter = Counter()
                with counting_host_reads(counts):
                    model(**inputs).logits.sum().backward()
                if attempt == "first":
                    first["HF Llama packed"] = sum(counts.values())
            assert not counts, dict(counts)
    finally:
        session.close()
    return log.failures, first


def _report(results) -> None:
    failures = [f for per_rank, _ in results for f in per_rank]
    assert not failures, "\n".join(failures[:3])
    for name, count in results[0][1].items():
        print(f"{name}: {count} host reads on the first call, 0 after")


@pytest.mark.timeout(120)
def test_prepared_attention_calls_read_nothing_on_the_host():
    _report(run_distributed(_attention_rank, 4, timeout=90))


@pytest.mark.timeout(120)
def test_hf_forward_backward_reads_nothing_on_the_host():
    _report(run_distributed(_hf_rank, 2, timeout=90))
