"""What runs inside a benchmark's rank processes: the :class:`Case`, its useful work, and the rank functions."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import MIB, Timing, current_rss_bytes, measure, release_free_memory

BWD_FLOP_FACTOR = 2.5  # backward flop ÷ forward flop (the FlashAttention convention)

AttentionFn = Callable[..., Any]  # attn(q, k, v, segment_lengths, dilation_rates) -> this rank's output shard


class Skip(Exception):
    """Raised by a ``build`` when a case cannot run here (e.g. a peer not installed): recorded, not an error."""


@dataclass(frozen=True)
class Case:
    """One configuration: which attention, on what shapes, on how many rank processes (``benchmarks/README.md``)."""

    impl: str
    seq: int
    world: int = 1
    threads: int = 1
    causal: bool = True
    segment_lengths: tuple[int, ...] | None = None
    dilation_rates: tuple[int, ...] | None = None
    layout: str = "contiguous"
    ulysses: int = 1
    group: bool = True
    fwd: bool = False
    warmup_seq: int | None = None
    tag: str = ""
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    kv_heads: int | None = None


def kept_positions(seg_len: int, offset: int, rate: int) -> int:
    return 0 if seg_len <= offset else (seg_len - offset + rate - 1) // rate


def causal_pairs(m: int, causal: bool) -> int:
    return m * (m + 1) // 2 if causal else m * m


def pairs_dilated(seq: int, heads: int, segs: Sequence[int], rates: Sequence[int], causal: bool) -> int:
    """Pairs of LongNet dilated attention, every head running every branch at offset ``h % r`` (ds_ring)."""
    total = 0
    for w, r in zip(segs, rates, strict=True):
        lens = [w] * (seq // w) + ([seq % w] if seq % w else [])
        total += sum(causal_pairs(kept_positions(n, h % r, r), causal) for h in range(heads) for n in lens)
    return total


def case_pairs(case: Case, seq: int) -> int:
    if case.segment_lengths is None:
        return case.heads * causal_pairs(seq, case.causal)
    return pairs_dilated(seq, case.heads, case.segment_lengths, case.dilation_rates or (), case.causal)


def useful_gflop(case: Case, pairs: int | None = None) -> float:
    """Useful fwd+bwd GFLOP of one call: 4·head_dim·batch flop per unmasked (query, key) pair, × 3.5 (README.md)."""
    pairs = case_pairs(case, case.seq) if pairs is None else pairs
    return (1.0 + BWD_FLOP_FACTOR) * 4.0 * case.head_dim * case.batch * pairs / 1e9


@dataclass(frozen=True)
class Protocol:
    """``calls`` timed calls per phase after a warm-up; ``timeout_s`` bounds every wait."""

    calls: int
    timeout_s: float


@dataclass
class RankResult:
    """One rank's measurements (RSS in MiB before the shards existed, what they added; ds_ring's ring waits)."""

    threads: int
    skipped: str | None = None
    warmup_s: float | None = None
    warmup_max_abs_err: float | None = None
    rss_before_inputs_mib: float = 0.0
    inputs_mib: float | None = None
    fwd: Timing | None = None
    fwdbwd: Timing | None = None
    blocked_s: float = 0.0
    in_flight_s: float = 0.0
    ring_steps: int = 0
    ring_bytes_sent: int = 0

    def working_mib(self, timing: Timing) -> float:
        """Peak RSS of a phase above the RSS before the shards existed (``benchmarks/SUITE.md``, working memory)."""
        return timing.baseline_rss_mib + timing.peak_extra_mib - self.rss_before_inputs_mib

    def __call__(self, event: Any) -> None:
        if event.kind == "ring_step":
            self.blocked_s += float(event.extra.get("wait_s", 0.0))
            self.in_flight_s += event.seconds
            self.ring_steps += 1
            self.ring_bytes_sent += event.nbytes


def attention_rank(
    rank: int, world: int, case: Case, build: Callable[[Case, int, float], AttentionFn], protocol: Protocol
) -> RankResult:
    """Rank function: build the attention, warm up, time ``fwd`` (if asked) and fwd+bwd calls on random shards."""
    import torch

    import ds_ring

    result = RankResult(threads=torch.get_num_threads())
    try:
        attn = build(case, rank, protocol.timeout_s)
    except Skip as exc:
        result.skipped = str(exc)
        return result
    gen = torch.Generator().manual_seed(1000 + rank)

    def shards(total: int) -> list[torch.Tensor]:  # q, k, v, grad_out
        heads = (case.heads, case.kv_heads or case.heads, case.kv_heads or case.heads, case.heads)
        return [torch.randn((case.batch, total // world, h, case.head_dim), generator=gen) for h in heads]

    segs, rates = case.segment_lengths, case.dilation_rates
    dense, warmup = case.warmup_seq is None, case.warmup_seq or max(1024, 256 * world)
    q, k, v, grad_out = (t.requires_grad_(i < 3) for i, t in enumerate(shards(warmup)))
    t0 = time.perf_counter()
    out = attn(q, k, v, None if dense else segs, None if dense else rates)
    out.backward(grad_out)
    result.warmup_s = time.perf_counter() - t0
    if dense and case.group:
        with torch.no_grad():
            ref = ds_ring.ring_dilated_attention(q, k, v, causal=case.causal, layout=case.layout,
                                                 timeout_s=protocol.timeout_s)  # fmt: skip
        result.warmup_max_abs_err = float((out.detach() - ref).abs().max())
    del q, k, v, grad_out, out
    release_free_memory()
    rss0 = current_rss_bytes()
    q, k, v, grad_out = shards(case.seq)
    result.rss_before_inputs_mib, result.inputs_mib = rss0 / MIB, (current_rss_bytes() - rss0) / MIB
    if case.fwd:
        with torch.no_grad():
            result.fwd = measure(lambda: attn(q, k, v, segs, rates), calls=protocol.calls)
    for t in (q, k, v):
        t.requires_grad_(True)

    def clear_grads() -> None:
        q.grad = k.grad = v.grad = None

    with ds_ring.register_hook(result):
        step = lambda: attn(q, k, v, segs, rates).backward(grad_out)
        result.fwdbwd = measure(step, calls=protocol.calls, setup=clear_grads)
    return result


def matmul_rank(rank: int, world: int, n: int) -> float:
    """Rank function: best fp32 ``n×n @ n×n`` GFLOP/s (2·n³ flop) of 5 timed calls after one warm-up."""
    import torch

    a, b, c, times = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n), []
    for _ in range(6):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / min(times[1:]) / 1e9
