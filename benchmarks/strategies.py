"""Sequence-parallel strategies at p = 4: ring vs all-gather vs Ulysses vs hybrid vs DeepSpeed's Ulysses.

    python -m benchmarks.strategies [--quick] [--out DIR]

Four rank processes × 1 thread, topology Ulysses 2 × ring 2 (``ring``, ``allgather`` and ``ulysses``
use the whole sequence-parallel group of 4; ``hybrid`` all-to-alls inside pairs and rings across),
contiguous shards; batch 1, 8 heads, head_dim 64, fp32, S = 4K..16K (``--quick``: 2K); dense causal,
dense non-causal and dilated causal (``w = [S/8, S/2, S]``, ``r = [1, 2, 4]``); forward (``no_grad``)
and forward+backward, ``--calls`` each. ``deepspeed`` is DeepSpeed's ``DistributedAttention`` with
SDPA inside (dense only). On 2 cores the 4 ranks time-share: compare strategies with each other.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from benchmarks import driver, peers
from benchmarks.driver import Case, Column, Session, find, fmt_seq, ratio

if TYPE_CHECKING:
    from torch import Tensor

IMPLS = ["ring", "allgather", "ulysses", "hybrid", "deepspeed"]
ATTENTIONS = [("dense", False), ("dense", True), ("dilated", True)]
LABELS = {
    "ring": "ds_ring ring",
    "allgather": "ds_ring all-gather",
    "ulysses": "ds_ring Ulysses",
    "hybrid": "ds_ring hybrid",
    "deepspeed": "DeepSpeed DistributedAttention + SDPA",
}


def build(case: Case, rank: int, timeout_s: float) -> driver.AttentionFn:
    """``ds_ring.sequence_parallel_attention`` with strategy ``case.impl`` over a Topology of ``case.ulysses``
    × ``world / ulysses`` ranks, or DeepSpeed's Ulysses over its sequence-parallel group."""
    import ds_ring

    topology = ds_ring.Topology(ulysses=case.ulysses, ring=case.world // case.ulysses)
    if case.impl == "deepspeed":
        return peers.deepspeed_attention(case, rank, topology.sequence_parallel_group)

    def attn(q: Tensor, k: Tensor, v: Tensor, segs: Any, rates: Any) -> Tensor:
        return ds_ring.sequence_parallel_attention(
            q, k, v, segs, rates, causal=case.causal, topology=topology, strategy=case.impl,
            layout=case.layout, timeout_s=timeout_s,
        )  # fmt: skip

    return attn


def plan(session: Session) -> None:
    args = session.args
    for seq in args.seqs or ([2048] if args.quick else [4096, 8192, 16384]):
        for attention, causal in ATTENTIONS:
            segs, rates = ((seq // 8, seq // 2, seq), (1, 2, 4)) if attention == "dilated" else (None, None)
            for impl in args.impls or IMPLS:
                session.run(Case(impl, seq, 4, ulysses=2, causal=causal, segment_lengths=segs, dilation_rates=rates,
                                 fwd=True, tag=attention))  # fmt: skip


def report(session: Session) -> str:
    rows = session.rows

    def versus(impl: str) -> Any:
        return lambda r: ratio(r, find(rows, impl=impl, seq=r.case.seq, tag=r.case.tag, causal=r.case.causal))

    columns = [
        Column("impl", lambda r: r.label),
        Column("seq", lambda r: r.case.seq, fmt_seq),
        Column("attention", lambda r: r.case.tag),
        Column("causal", lambda r: "yes" if r.case.causal else "no"),
        Column("procs × threads", lambda r: r.procs),
        Column("fwd s", lambda r: r.fwd_s, "{:.3f}"),
        Column("fwd+bwd s", lambda r: r.fwdbwd_s, "{:.3f}"),
        Column("fwd peak MiB/rank", lambda r: r.fwd_peak_mib, "{:.1f}"),
        Column("fwd+bwd peak MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
        Column("fwd+bwd ÷ ring", versus("ring"), "{:.2f}"),
        Column("fwd+bwd ÷ DeepSpeed", versus("deepspeed"), "{:.2f}"),
        Column("warm-up err", lambda r: r.warmup_max_abs_err, "{:.1e}"),
        Column("other load %", lambda r: r.other_cpu_pct, "{:.0f}"),
        Column("notes", lambda r: "; ".join(r.notes)),
    ]
    return driver.markdown_table(rows, columns)


def plots(session: Session) -> None:
    title = "p=4 (4 processes × 1 thread), U2×R2, B1 H8 D64 fp32"
    panel = lambda r: f"{r.case.tag}, {'causal' if r.case.causal else 'non-causal'}"
    for name, ylabel, y in (
        ("time", "fwd+bwd time per call, slowest rank (s)", lambda r: r.fwdbwd_s),
        ("memory", "fwd+bwd peak working memory, largest rank (MiB)", lambda r: r.peak_mib),
    ):
        path = session.out / f"strategies_{name}.png"
        driver.plot_rows(
            path, session.rows, panel=panel, ylabel=ylabel, title=title, phases=(("", y, "-o"),), logy=False
        )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seqs", type=int, nargs="+", help="sequence lengths, multiples of 64 (default 4K 8K 16K, quick 2K)"
    )
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="implementations (default all)")


BENCHMARK = driver.Benchmark(
    name="strategies", module="benchmarks.strategies", title="sequence-parallel strategies, p = 4, Ulysses 2 × ring 2",
    plan=plan, build=build, report=report, plots=plots, add_args=add_args, label=lambda case: LABELS[case.impl],
    packages=("deepspeed",), calls=3,
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(driver.main(BENCHMARK))
