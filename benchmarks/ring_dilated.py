"""Ring dilated attention vs dense ring vs single-process dilated attention, on CPU ranks (issue 4).

    python -m benchmarks.ring_dilated [--quick] [--out DIR]

Causal, batch 1, 8 heads, head_dim 64, fp32, S = 32K..256K in total (``--quick``: 8K, 16K), p = 1,
2, 4 rank processes × 1 thread. LongNet branches scale with the sequence: ``w = [min(2048, S/16),
min(8192, S/4), S]``, ``r = [1, 4, 16]``: with shards of S/p tokens the short branches stay on a
rank and the S branch passes only every 16th K/V row around the ring (DESIGN §2). Rows: ring dilated
(``ring_dilated_attention``, contiguous), dense ring (zigzag), and ``ds_ring.dilated_attention`` in
one process with 1 and 2 threads. Dense ring beyond ``--max-call-s`` (256K: ~250 TFLOP useful per
call) is recorded as skipped with the estimate.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import dilated, ring, strategies
from benchmarks.driver import (
    AttentionFn,
    Benchmark,
    Case,
    Column,
    Row,
    Session,
    Target,
    find,
    fmt_seq,
    format_targets,
    main,
    markdown_table,
    ratio,
)

IMPLS = ["ring_dilated", "dense_ring", "single_1t", "single_2t"]


def case_of(name: str, seq: int, p: int) -> Case:
    """The case a command-line row name stands for."""
    branches = dict(segment_lengths=(min(2048, seq // 16), min(8192, seq // 4), seq), dilation_rates=(1, 4, 16))
    if name == "dense_ring":
        return Case("ring", seq, p, layout="zigzag")
    if name == "ring_dilated":
        return Case("ring", seq, p, **branches)
    return Case("ds_ring", seq, 1, threads=int(name[-2]), group=False, **branches)


def label(case: Case) -> str:
    if not case.group:
        return f"ds_ring.dilated_attention, 1 process × {case.threads} thread{'s' if case.threads > 1 else ''}"
    return "ds_ring ring dilated" if case.segment_lengths else "ds_ring dense ring (zigzag)"


def build(case: Case, rank: int, timeout_s: float) -> AttentionFn:
    return strategies.build(case, rank, timeout_s) if case.group else dilated.build(case, rank, timeout_s)


def plan(session: Session) -> None:
    args = session.args
    for seq in args.seqs or ([8192, 16384] if args.quick else [32768, 65536, 131072, 262144]):
        for name in args.impls or IMPLS:
            for p in [1] if name.startswith("single") else args.worlds or [1, 2, 4]:
                session.run(case_of(name, seq, p))


def report(session: Session) -> str:
    rows = session.rows
    same = lambda r, **kw: find(rows, seq=r.case.seq, **kw) if r.case.segment_lengths and r.case.group else None  # noqa: E731
    dense = lambda r: same(r, world=r.case.world, layout="zigzag")  # noqa: E731
    p1 = lambda r: find(rows, impl=r.case.impl, seq=r.case.seq, layout=r.case.layout, world=1, threads=r.case.threads)  # noqa: E731
    columns = [
        *ring.COLUMNS,
        Column(
            "w / r",
            lambda r: (
                f"{[fmt_seq(w) for w in r.case.segment_lengths]} / {list(r.case.dilation_rates)}".replace("'", "")
                if r.case.segment_lengths
                else "dense"
            ),
        ),
        Column("mem ÷ p=1", lambda r: ratio(r, p1(r), "peak_mib"), "{:.2f}"),
        Column("speed-up vs p=1", lambda r: ratio(p1(r), r), "{:.2f}"),
        Column("× faster than dense ring", lambda r: ratio(dense(r), r), "{:.1f}"),
        Column("mem ÷ dense ring", lambda r: ratio(r, dense(r), "peak_mib"), "{:.2f}"),
        Column("× faster than 1 proc × 2 thr", lambda r: ratio(same(r, group=False, threads=2), r), "{:.2f}"),
        *ring.TAIL,
    ]
    session.targets = summary(rows, p1, dense)
    return markdown_table(rows, columns) + "\n\n" + format_targets(session.targets)


def summary(rows: list[Row], p1, dense) -> list[Target]:
    """Issue 4's headline ratios (it set no numeric targets: all 'info')."""
    out = []
    for r in rows:
        if not (r.case.group and r.case.segment_lengths):
            continue
        at = f"{fmt_seq(r.case.seq)} p={r.case.world}"
        if r.case.world > 1 and (mem := ratio(r, p1(r), "peak_mib")) is not None:
            out.append(
                Target(
                    f"ring dilated memory per rank ÷ p=1, {at}",
                    mem,
                    None,
                    f"{r.peak_mib:.0f} MiB vs {r.peak_mib / mem:.0f} MiB",
                )
            )
        if (x := ratio(dense(r), r)) is not None:
            out.append(
                Target(
                    f"ring dilated × faster than dense ring, {at}",
                    x,
                    None,
                    f"{r.fwdbwd_s:.2f} s vs {r.fwdbwd_s * x:.2f} s",
                )
            )
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", type=int, nargs="+", help="total sequence lengths, multiples of 64 (default 32K..256K)")
    p.add_argument("--worlds", type=int, nargs="+", help="rank counts (default 1 2 4)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="rows (default all)")


BENCHMARK = Benchmark(
    name="ring_dilated", module="benchmarks.ring_dilated", title="ring dilated attention (issue 4)",
    plan=plan, build=build, report=report, add_args=add_args, label=label,
    plots=lambda s: ring.plot_by_world(s, "ring dilated attention (w=[2K,8K,S], r=[1,4,16]), causal, B1 H8 D64 fp32"),
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(main(BENCHMARK))
