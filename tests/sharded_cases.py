"""Checks one distributed attention case against the float64 oracle on the gathered tensors.

Each rank builds the same full q/k/v (same seed), runs the attention under test on its shard,
and compares its output, LSE and q/k/v gradients with the shard of the oracle's. A rank function
runs many cases in one spawn and returns the failures, so one failing case names itself.

A case with ``cu_seqlens`` (packed documents) is checked against the oracle run on each document
alone (:func:`per_document_reference`), which shares nothing with the packed code path. A case may give
``v`` a head dim of its own (``v_head_dim``, multi-head latent attention), cap scores (``softcap``) and make spans
bidirectional inside the causal sequence (``spans``: ``(start, stop)`` pairs or per-token ids; ``prefix``: prefix-LM
lengths), which the oracle gets resolved to pairs, each document's relative to its start.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch

import ds_ring
import ds_ring.kernels.overwrite as overwrite
from ds_ring.calls import sequence_parallel_attention
from ds_ring.kernels.spans import resolve_spans
from ds_ring.reference import dilated_attention_reference
from tests.dist import CaseLog, assert_no_failures, run_distributed

DTYPES = {"float64": (torch.float64, 1e-10), "float32": (torch.float32, 3e-5)}


def full_inputs(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """Full-sequence ``q [b, s, h, d]``, ``k [b, s, hkv, d]``, ``v [b, s, hkv, dv]``, ``dout [b, s, h, dv]`` for a
    case (``dv``: ``v_head_dim``, default ``head_dim``), identical on every rank."""
    dtype = DTYPES[case.get("dtype", "float64")][0]
    g = torch.Generator().manual_seed(case.get("seed", 0))
    b, s, h, hkv, d = case["batch"], case["seq"], case["heads"], case["kv_heads"], case["head_dim"]
    dv = case.get("v_head_dim", d)
    q = torch.randn(b, s, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, s, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(b, s, hkv, dv, generator=g, dtype=dtype)
    dout = torch.randn(b, s, h, dv, generator=g, dtype=dtype)
    return q, k, v, dout


def per_document_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs, rates, cu_seqlens: list[int], **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle on each document ``[cu[i], cu[i+1])`` alone, outputs and LSEs concatenated (differentiable);
    ``bidirectional_spans`` (global pairs) given to each document relative to its start."""
    spans = kwargs.pop("bidirectional_spans", None) or ()
    pieces = [
        dilated_attention_reference(
            q[:, a:b], k[:, a:b], v[:, a:b], segs, rates, bidirectional_spans=_within(spans, a, b), **kwargs
        )
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)
    ]
    return torch.cat([o for o, _ in pieces], dim=1), torch.cat([lse for _, lse in pieces], dim=2)


def _within(spans, start: int, stop: int) -> list[tuple[int, int]]:
    return [(a - start, b - start) for a, b in spans if start <= a < stop]


def check_case(case: dict[str, Any], attention: Callable[..., Any], group=None) -> None:
    """Run ``attention(q, k, v, segs, rates, causal=..., head_offset=..., return_lse=True)`` on shards
    (with ``cu_seqlens=`` when the case packs documents, ``window=``, ``softcap=`` and ``sinks=`` when it has them;
    the sinks' gradient is each rank's rows' share, summed over ``group`` before it is compared)."""
    dtype, atol = DTYPES[case.get("dtype", "float64")]
    layout = case.get("layout", "contiguous")
    segs, rates = case.get("segments"), case.get("rates")
    head_offset = case.get("head_offset", 0)
    cu = case.get("cu_seqlens")
    extra: dict[str, Any] = {} if cu is None else {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    if case.get("window") is not None:
        extra["window"] = case["window"]
    if case.get("softcap") is not None:
        extra["softcap"] = case["softcap"]
    if case.get("spans") is not None:
        spans = case["spans"]
        extra["bidirectional_spans"] = torch.tensor(spans) if spans and isinstance(spans[0], int) else spans
    if case.get("prefix") is not None:
        extra["prefix_lengths"] = case["prefix"]
    q, k, v, dout = full_inputs(case)
    sinks = None
    if case.get("sinks"):
        sinks = torch.randn(case["heads"], generator=torch.Generator().manual_seed(case.get("seed", 0)), dtype=dtype)
        sinks.requires_grad_()
        extra["sinks"] = sinks
    shard = lambda x: ds_ring.shard_sequence(x, group, layout=layout)  # noqa: E731
    local = [shard(x).requires_grad_() for x in (q, k, v)]
    out, lse = attention(
        *local, segs, rates, causal=case["causal"], head_offset=head_offset, return_lse=True, layout=layout, **extra
    )
    full = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    options = dict(
        causal=case["causal"], head_offset=head_offset, window=case.get("window"), softcap=case.get("softcap")
    )
    if case.get("spans") is not None or case.get("prefix") is not None:
        bounds = cu or [0, case["seq"]]
        options["bidirectional_spans"] = resolve_spans(case.get("spans"), case.get("prefix"), bounds)
    if sinks is not None:
        full.append(sinks.detach().clone().requires_grad_())
        options["sinks"] = full[-1]
    if cu is None:
        ref_out, ref_lse = dilated_attention_reference(*full[:3], segs, rates, **options)
    else:
        ref_out, ref_lse = per_document_reference(*full[:3], segs, rates, cu, **options)
    ref_grads = torch.autograd.grad(ref_out, full, dout.double())
    grads = torch.autograd.grad(out, local + ([sinks] if sinks is not None else []), shard(dout))
    if sinks is not None:
        dsinks = grads[3].detach().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(dsinks, group=group)
        torch.testing.assert_close(
            dsinks.double(), ref_grads[3].double(), rtol=0, atol=atol * 10, msg=lambda m: f"dsinks: {m}"
        )
        grads, ref_grads = grads[:3], ref_grads[:3]
    assert out.dtype == dtype and out.shape == (*local[0].shape[:-1], v.shape[-1])
    torch.testing.assert_close(out.double(), shard(ref_out), rtol=0, atol=atol, msg=lambda m: f"out: {m}")
    ref_lse = ds_ring.shard_sequence(ref_lse, group, layout=layout, dim=2)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=0, atol=atol, msg=lambda m: f"lse: {m}")
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(
            got.double(), shard(want.double()), rtol=0, atol=atol * 10, msg=lambda m, n=name: f"d{n}: {m}"
        )


def run_cases(cases: list[dict[str, Any]], attention: Callable[..., Any], group=None) -> list[str]:
    """Check every case; return the failures, each with its case and traceback (empty when all pass)."""
    log = CaseLog()
    for case in cases:
        with log.case(str(case)), _block_rows(case.get("block_rows")):
            check_case(case, attention, group)
    return log.failures


@contextlib.contextmanager
def _block_rows(rows: int | None) -> Iterator[None]:
    """With ``rows``, backward calls of at most that many rows a side (``ds_ring.kernels.overwrite.BLOCK_ROWS``: the
    ring's own runs, Ulysses' head shards), so a few rows per rank take the tiled paths."""
    default = overwrite.BLOCK_ROWS
    overwrite.BLOCK_ROWS = rows or default
    try:
        yield
    finally:
        overwrite.BLOCK_ROWS = default


def ring_rank(rank: int, world: int, cases: list[dict[str, Any]]) -> list[str]:
    """Rank function: every case through ``ds_ring.ring_dilated_attention`` with the case's communication."""
    failures = []
    for case in cases:
        attention = functools.partial(ds_ring.ring_dilated_attention, communication=case["communication"])
        failures += run_cases([case], attention)
    return failures


def strategy_rank(rank: int, world: int, ulysses: int, ring: int, cases: list[dict[str, Any]]) -> list[str]:
    """Rank function: every case through ``sequence_parallel_attention`` over a ``ulysses × ring`` topology, with
    the case's strategy and communication (absent: the strategy's default)."""
    topology = ds_ring.Topology(ulysses=ulysses, ring=ring)
    failures = []
    for case in cases:
        attention = functools.partial(
            sequence_parallel_attention, topology=topology, strategy=case["strategy"],
            communication=case.get("communication"),
        )  # fmt: skip
        failures += run_cases([case], attention, group=topology.sequence_parallel_group)
    return failures


def assert_refused_on_one_rank(kwargs: dict[str, Any], message: str) -> None:
    """``dilated_attention`` and ``ring_dilated_attention`` without a process group (one rank) both refuse a causal
    call on ``[1, 16, 4, 8]`` tensors with ``kwargs`` (which may set ``causal``): a ``ValueError`` matching
    ``message``."""
    q = torch.randn(1, 16, 4, 8)
    for attention in (ds_ring.dilated_attention, ds_ring.ring_dilated_attention):
        with pytest.raises(ValueError, match=message):
            attention(q, q, q, **{"causal": True, **kwargs})


def seeded(cases: Iterable[dict[str, Any]], **common: Any) -> list[dict[str, Any]]:
    """``cases`` with the ``common`` fields added and ``seed`` set to each case's position (own inputs per case)."""
    return [{**case, **common, "seed": seed} for seed, case in enumerate(cases)]


def strategy_pairs(ring: int) -> list[tuple[str, str | None]]:
    """``(strategy, communication)`` of the strategies a ``ulysses × ring`` topology runs beside ring and all-gather:
    Ulysses, and with a ring dimension (``ring > 1``) hybrid over each exchange."""
    return [("ulysses", None)] + ([("hybrid", "ring"), ("hybrid", "allgather")] if ring > 1 else [])


class EveryStrategy:
    """Base of a test class checking one feature against the oracle on every strategy: ring and all-gather
    (:func:`ring_rank`) over 1-4 ranks, Ulysses over 2 and hybrid 2 × 2 (:func:`strategy_rank`). A subclass names
    its cases (each list made by :func:`seeded`)."""

    ring_cases: Callable[[int], list[dict[str, Any]]]
    """The cases of a ring over ``world`` ranks (each with its ``communication``)."""
    strategy_cases: Callable[[int, int], list[dict[str, Any]]]
    """The cases over ``world`` ranks of a topology with ``ring`` ring ranks (each with its ``strategy``)."""

    @pytest.mark.timeout(240)
    @pytest.mark.parametrize("world", [1, 2, 3, 4])
    def test_ring_and_allgather(self, world: int) -> None:
        assert_no_failures(run_distributed(ring_rank, world, timeout=200, cases=self.ring_cases(world)))

    @pytest.mark.timeout(240)
    @pytest.mark.parametrize(("world", "ulysses", "ring"), [(2, 2, 1), (4, 2, 2)], ids=["ulysses2", "hybrid2x2"])
    def test_ulysses_and_hybrid(self, world: int, ulysses: int, ring: int) -> None:
        cases = self.strategy_cases(world, ring)
        assert_no_failures(run_distributed(strategy_rank, world, timeout=200, ulysses=ulysses, ring=ring, cases=cases))
