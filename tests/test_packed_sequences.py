"""Packed sequences (``cu_seqlens``): every document is attended as if alone, on every strategy.

Checked against the float64 oracle run on each document separately (outputs, LSE, dq/dk/dv), single
process and p = 1-4, dense and dilated, causal and not, both layouts (zigzag: dense), GQA; with
documents that cross shard and segment boundaries, span every rank, or are one token long. What
travels is counted by a hook: documents that stay on their rank send nothing, and causal documents
that only cross into the next rank make one hop instead of p - 1.
"""

import functools
import itertools

import pytest
import torch

import ds_ring
from ds_ring.calls import sequence_parallel_attention
from ds_ring.hooks import register_hook
from ds_ring.parallel.topology import Topology
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.sharded_cases import ring_rank, run_cases

L = 8  # rows per rank


def _documents(seq: int) -> dict[str, list[int]]:
    """Boundary layouts over a sequence of ``seq`` rows (``seq`` = world × L, or 24 on one process)."""
    return {
        "crossing shards": sorted({0, 5, min(13, seq - 1), seq}),
        "one spanning all, 1-token ends": [0, 1, seq - 1, seq],
        "aligned to shards": list(range(0, seq + 1, L)),
        "many short": [*range(0, seq - 1, 3), seq] if (seq - 1) % 3 else [*range(0, seq, 3), seq],
    }


BRANCHES = [
    (None, None),  # dense: one segment per document
    ([4, 8, 32], [1, 2, 4]),  # segments shorter than, equal to and longer than documents
    ([6, 12], [1, 3]),  # segments that divide neither the shard nor the documents
]
HEADS = [(4, 4, 0), (4, 2, 1), (6, 2, 3)]  # (heads, kv_heads, head_offset)


def _case(seq: int, cu: list[int], segs, rates, causal: bool, heads: tuple[int, int, int], i: int, **extra) -> dict:
    h, hkv, offset = heads
    return dict(
        cu_seqlens=cu, segments=segs, rates=rates, causal=causal, heads=h, kv_heads=hkv, head_offset=offset,
        batch=2, seq=seq, head_dim=4, seed=i, dtype="float32" if i % 7 == 6 else "float64", **extra,
    )  # fmt: skip


def _ring_cases(world: int) -> list[dict]:
    seq = world * L
    cases = []
    combos = itertools.product(_documents(seq).values(), BRANCHES, ["ring", "allgather"], [False, True])
    for i, (cu, (segs, rates), comm, causal) in enumerate(combos):
        cases.append(_case(seq, cu, segs, rates, causal, HEADS[i % len(HEADS)], i, communication=comm))
    for i, (cu, comm) in enumerate(itertools.product(_documents(seq).values(), ["ring", "allgather"])):
        cases.append(_case(seq, cu, None, None, True, HEADS[i % 2], 100 + i, communication=comm, layout="zigzag"))
    return cases


def _single(q, k, v, segs, rates, *, layout, **kwargs):
    return ds_ring.dilated_attention(q, k, v, segs, rates, **kwargs)


@pytest.mark.slow  # ~20 s of one core: CI's second step
def test_single_process_matches_each_document_alone():
    cases = [
        _case(24, cu, segs, rates, causal, heads, i)
        for i, (cu, (segs, rates), causal, heads) in enumerate(
            itertools.product(_documents(24).values(), BRANCHES, [False, True], HEADS)
        )
    ]
    cases.append(_case(24, [0, 24], [4, 8], [1, 2], True, HEADS[1], 999))  # one document = no cu_seqlens
    failures = run_cases(cases, _single)
    assert not failures, "\n".join(failures[:3])


def test_packed_call_equals_documents_run_one_by_one():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = [0, 7, 8, 29, 40]
    out, lse = ds_ring.dilated_attention(
        q, k, v, [4, 16], [1, 2], causal=True, return_lse=True, cu_seqlens=torch.tensor(cu)
    )
    for a, b in itertools.pairwise(cu):
        alone, alone_lse = ds_ring.dilated_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], [4, 16], [1, 2], causal=True, return_lse=True
        )
        torch.testing.assert_close(out[:, a:b], alone, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[..., a:b], alone_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        (torch.tensor([1, 8, 16]), r"must start at 0"),
        (torch.tensor([0, 8, 15]), r"must end at the \(global\) sequence length 16"),
        (torch.tensor([0, 8, 8, 16]), r"strictly increasing"),
        (torch.tensor([0, 9, 4, 16]), r"strictly increasing"),
        (torch.tensor([0.0, 16.0]), r"1-D integer tensor"),
        (torch.tensor([[0, 16]]), r"1-D integer tensor"),
        (torch.tensor([16]), r"at least \[0, seq_len\]"),
        ([0, 8.5, 16], r"must hold integers"),
    ],
)
def test_invalid_boundaries_are_refused(cu_seqlens, message):
    q = torch.randn(1, 16, 2, 4)
    with pytest.raises(ValueError, match=message):
        ds_ring.dilated_attention(q, q, q, cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match=message):  # single-rank group: refused before any communication
        ds_ring.ring_dilated_attention(q, q, q, cu_seqlens=cu_seqlens)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_and_allgather_packed_match_reference(world):
    assert_no_failures(run_distributed(ring_rank, world, timeout=200, cases=_ring_cases(world)))


STRATEGIES = [("ring", "ring"), ("allgather", None), ("ulysses", None), ("hybrid", "ring"), ("hybrid", "allgather")]


def _strategy_rank(rank: int, world: int, ulysses: int, ring: int) -> list[str]:
    topology = Topology(ulysses=ulysses, ring=ring)
    seq = world * L
    failures = []
    combos = itertools.product(STRATEGIES, _documents(seq).values(), BRANCHES[:2], ["contiguous", "zigzag"])
    for i, ((strategy, comm), cu, (segs, rates), layout) in enumerate(combos):
        if (
            layout == "zigzag"
            and segs is not None
            and not (strategy == "ulysses" or (strategy == "hybrid" and ring == 1))
        ):
            continue  # a ring dimension shards dilated attention contiguously only
        heads = [(4, 4, 0), (4, 2, 1), (4, 1, 0)][i % 3]  # one K/V head: fewer than the ulysses degree
        case = _case(seq, cu, segs, rates, i % 2 == 1, heads, i, layout=layout)
        attention = functools.partial(
            sequence_parallel_attention, topology=topology, strategy=strategy, communication=comm
        )
        failures += run_cases([case], attention, group=topology.sequence_parallel_group)
    return failures


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("ulysses", "ring"), [(2, 1), (1, 2), (2, 2), (4, 1)], ids=["u2", "r2", "u2xr2", "u4"])
def test_every_strategy_packed_matches_reference(ulysses, ring):
    assert_no_failures(run_distributed(_strategy_rank, ulysses * ring, timeout=130, ulysses=ulysses, ring=ring))


def _sent_bytes(segs, rates, cu: list[int], *, causal: bool, backward: bool = False) -> tuple[int, int]:
    """(K/V blocks this rank sent, bytes every transfer of this rank sent) for one packed ring call."""
    rank = torch.distributed.get_rank()
    q, k, v = (torch.randn(1, L, 4, 8, requires_grad=backward) for _ in range(3))
    events = []
    with register_hook(events.append):
        out = ds_ring.ring_dilated_attention(q, k, v, segs, rates, causal=causal, cu_seqlens=torch.tensor(cu))
        if backward:
            out.sum().backward()
    mine = [e for e in events if e.kind == "send" and e.rank == rank]
    return sum(e.op == "ring_kv" for e in mine), sum(e.nbytes for e in mine)


def _traffic_rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    seq = world * L
    with log.case("documents aligned to shards: nothing is sent, forward or backward"):
        for segs, rates in BRANCHES:
            assert _sent_bytes(segs, rates, list(range(0, seq + 1, L)), causal=False, backward=True)[1] == 0
    half = [0, L // 2, *range(L + L // 2, seq, L), seq]  # every document crosses one shard boundary
    last = rank == world - 1  # its block reaches no later rank: an empty block is not sent
    with log.case("causal documents crossing into the next rank: one hop, not p - 1"):
        blocks, nbytes = _sent_bytes(None, None, half, causal=True)
        assert blocks == (0 if last else 1), blocks
        # only the rows of the crossing document travel: L/2 rows of K and V, 4 heads × 8, fp32
        assert nbytes == (0 if last else 2 * (L // 2) * 4 * 8 * 4), nbytes
    with log.case("the same, forward and backward: one K/V hop each way, gradients home in one transfer"):
        blocks, _ = _sent_bytes(None, None, half, causal=True, backward=True)
        assert blocks == (0 if last else 2), blocks
    return log.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_packed_traffic_follows_the_documents(world):
    assert_no_failures(run_distributed(_traffic_rank, world, timeout=90))


def test_attention_module_passes_documents():
    """``MultiheadRingDilatedAttention(..., cu_seqlens=)`` equals the module on each document alone."""
    torch.manual_seed(0)
    attn = ds_ring.MultiheadRingDilatedAttention(16, 4, 2, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=True)
    attn = attn.double()
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    cu = [0, 6, 7, 20]
    packed, _ = attn(x, cu_seqlens=torch.tensor(cu))
    alone = torch.cat([attn(x[:, a:b])[0] for a, b in itertools.pairwise(cu)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
