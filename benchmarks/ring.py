"""Dense causal ring attention on CPU ranks: ring vs all-gather vs ``ring-attention-pytorch`` (issue 3).

    python -m benchmarks.ring [--quick] [--out DIR]

Per-rank working memory and forward+backward time of dense causal attention (batch 1, 8 heads,
head_dim 64, fp32), S = 16K..128K in total (``--quick``: 8K, 16K), p = 1, 2, 4 rank processes × 1
thread. ``ring`` / ``ring_zigzag``: ds_ring's ring with contiguous / zigzag shards; ``allgather``;
``rap``: ring-attention-pytorch 0.5.20's CPU ring path; ``torch_cp``: PyTorch ``context_parallel``
(fails on CPU; the row records the error). At p = 1 the ds_ring variants are one computation: one
``ring`` row stands for all of them.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import driver, peers, strategies
from benchmarks.driver import Case, Column, Row, Session, Target, find, fmt_seq, ratio

IMPLS = {"ring": ("ring", "contiguous"), "ring_zigzag": ("ring", "zigzag"), "allgather": ("allgather", "contiguous"),
         "rap": ("rap", "contiguous"), "torch_cp": ("torch_cp", "contiguous")}  # fmt: skip
"""Command-line name -> (implementation, layout)."""
DS_RING = ("ring", "allgather")
LABELS = {
    "allgather": "ds_ring all-gather",
    "rap": "ring-attention-pytorch 0.5.20",
    "torch_cp": "torch context_parallel",
}


def label(case: Case) -> str:
    return LABELS.get(case.impl) or f"ds_ring ring ({case.layout})"


def build(case: Case, rank: int, timeout_s: float) -> driver.AttentionFn:
    """ring-attention-pytorch, ``context_parallel``, or ds_ring (:func:`benchmarks.strategies.build`)."""
    if case.impl == "rap":
        return peers.rap_attention(case)
    if case.impl == "torch_cp":
        return peers.torch_cp_attention(case)
    return strategies.build(case, rank, timeout_s)


def plan(session: Session) -> None:
    args = session.args
    for seq in args.seqs or ([8192, 16384] if args.quick else [16384, 32768, 65536, 131072]):
        for p in args.worlds or [1, 2, 4]:
            for name in args.impls or IMPLS:
                if p > 1 or name in ("ring", "rap"):
                    impl, layout = IMPLS[name]
                    session.run(Case(impl, seq, p, layout=layout))


def p1(rows: list[Row], r: Row) -> Row | None:
    """The p = 1 ds_ring row of ``r``'s length, for ds_ring rows."""
    return find(rows, impl="ring", seq=r.case.seq, world=1) if r.case.impl in DS_RING else None


def targets(rows: list[Row], cores: int) -> list[Target]:
    """Issue 3's targets on this run's rows."""
    out = []
    for r in rows:
        mem, speed, rap = ratio(r, p1(rows, r), "peak_mib"), ratio(p1(rows, r), r), rap_ratio(rows, r)
        seq, at = fmt_seq(r.case.seq), f"{fmt_seq(r.case.seq)} p={r.case.world}"
        if r.case.world == 4 and mem is not None:
            aside = r.case.impl == "allgather"
            detail = f"{r.peak_mib:.0f} MiB vs {r.peak_mib / mem:.0f} MiB" + (
                " (beside it, no target)" if aside else ""
            )
            out.append(
                Target(
                    f"{r.label} memory per rank at p=4 ≤ 0.30 × p=1, {seq}", mem, None if aside else mem <= 0.3, detail
                )
            )
        if r.case.world == 2 and r.case.impl == "ring" and speed is not None:
            note = "" if cores >= 2 else f" (only {cores} usable core: not meaningful)"
            detail = f"{r.fwdbwd_s:.2f} s vs {r.fwdbwd_s * speed:.2f} s{note}; other load {r.other_cpu_pct or 0:.0f}%"
            out.append(
                Target(f"{r.label}: 2 ranks on 2 cores ≥ 1.8× faster than 1 rank, {seq}", speed, speed >= 1.8, detail)
            )
        if r.case.impl in DS_RING and rap is not None:
            detail = f"{r.fwdbwd_s:.2f} s vs {r.fwdbwd_s * rap:.2f} s"
            out.append(Target(f"{r.label} ≥ 5× faster than ring-attention-pytorch, {at}", rap, rap >= 5.0, detail))
    return out


def rap_ratio(rows: list[Row], r: Row) -> float | None:
    """How many times faster ``r`` is than ring-attention-pytorch on the same length and ranks."""
    return ratio(find(rows, impl="rap", seq=r.case.seq, world=r.case.world), r) if r.case.impl != "rap" else None


COLUMNS = [
    Column("impl", lambda r: r.label),
    Column("seq", lambda r: r.case.seq, fmt_seq),
    Column("procs × threads", lambda r: r.procs),
    Column("fwd+bwd s", lambda r: r.fwdbwd_s, "{:.2f}"),
    Column("tokens/s", lambda r: r.tokens_per_s, "{:.0f}"),
    Column("useful GFLOP/s", lambda r: r.gflops, "{:.1f}"),
    Column("peak MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
    Column("inputs MiB/rank", lambda r: r.inputs_mib, "{:.1f}"),
]
TAIL = [
    Column("wall ÷ compute", lambda r: r.overlap_ratio, "{:.2f}"),
    Column("warm-up err", lambda r: r.warmup_max_abs_err, "{:.1e}"),
    Column("other load %", lambda r: r.other_cpu_pct, "{:.0f}"),
    Column("notes", lambda r: "; ".join(r.notes)),
]
"""Columns every multi-rank table ends with."""


def report(session: Session) -> str:
    rows = session.rows
    columns = [
        *COLUMNS,
        Column("mem ÷ p=1", lambda r: ratio(r, p1(rows, r), "peak_mib"), "{:.2f}"),
        Column("speed-up vs p=1", lambda r: ratio(p1(rows, r), r), "{:.2f}"),
        Column("× faster than rap", lambda r: rap_ratio(rows, r), "{:.1f}"),
        *TAIL,
    ]
    session.targets = targets(rows, session.cores)
    return driver.markdown_table(rows, columns) + "\n\n" + driver.format_targets(session.targets)


def plot_by_world(session: Session, title: str) -> None:
    """``<name>_time.png`` and ``<name>_memory.png``: one panel per rank count, one line per implementation."""
    panel = lambda r: f"p = {r.case.world} rank{'s' if r.case.world > 1 else ''} × 1 thread"
    for name, ylabel, y in (
        ("time", "fwd+bwd time per call, slowest rank (s)", lambda r: r.fwdbwd_s),
        ("memory", "peak working memory, largest rank (MiB)", lambda r: r.peak_mib),
    ):
        path = session.out / f"{session.bench.name}_{name}.png"
        driver.plot_rows(path, session.rows, panel=panel, ylabel=ylabel, title=title, phases=(("", y, "-o"),))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", type=int, nargs="+", help="total sequence lengths (default 16K..128K, quick 8K 16K)")
    p.add_argument("--worlds", type=int, nargs="+", help="rank counts (default 1 2 4)")
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), help="implementations (default all)")


BENCHMARK = driver.Benchmark(
    name="ring", module="benchmarks.ring", title="dense causal ring attention (issue 3)",
    plan=plan, build=build, report=report, add_args=add_args, label=label,
    plots=lambda s: plot_by_world(s, "dense causal ring attention, B1 H8 D64 fp32, 1 thread per rank"),
    efficiency=peers.EFFICIENCY, packages=("ring-attention-pytorch", "deepspeed"),
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(driver.main(BENCHMARK))
