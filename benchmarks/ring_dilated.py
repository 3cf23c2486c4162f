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

from benchmarks import dilated, driver, ring, strategies
from benchmarks.driver import Case, Column, Row, Session, Target, find, fmt_seq, ratio

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


def build(case: Case, rank: int, timeout_s: float) -> driver.AttentionFn:
    return strategies.build(case, rank, timeout_s) if case.group else dilated.build(case, rank, timeout_s)


def plan(session: Session) -> None:
    args = session.args
    for seq in args.seqs or ([8192, 16384] if args.quick else [32768, 65536, 131072, 262144]):
        for name in args.impls or IMPLS:
            for p in [1] if name.startswith("single") else args.worlds or [1, 2, 4]:
                session.run(case_of(name, seq, p))


class Refs:
    """The rows a ring dilated row is compared with: its p = 1 row, dense ring and one process × 2 threads."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def p1(self, r: Row) -> Row | None:
        case = r.case
        return find(self.rows, impl=case.impl, seq=case.seq, layout=case.layout, world=1, threads=case.threads)

    def dense(self, r: Row) -> Row | None:
        return find(self.rows, seq=r.case.seq, world=r.case.world, layout="zigzag") if self.ring_dilated(r) else None

    def single(self, r: Row) -> Row | None:
        return find(self.rows, seq=r.case.seq, group=False, threads=2) if self.ring_dilated(r) else None

    @staticmethod
    def ring_dilated(r: Row) -> bool:
        return r.case.group and r.case.segment_lengths is not None


def branches_text(r: Row) -> str:
    segs, rates = r.case.segment_lengths, r.case.dilation_rates
    return f"[{', '.join(map(fmt_seq, segs))}] / {list(rates)}" if segs else "dense"


def report(session: Session) -> str:
    rows, ref = session.rows, Refs(session.rows)
    columns = [
        *ring.COLUMNS,
        Column("w / r", branches_text),
        Column("mem ÷ p=1", lambda r: ratio(r, ref.p1(r), "peak_mib"), "{:.2f}"),
        Column("speed-up vs p=1", lambda r: ratio(ref.p1(r), r), "{:.2f}"),
        Column("× faster than dense ring", lambda r: ratio(ref.dense(r), r), "{:.1f}"),
        Column("mem ÷ dense ring", lambda r: ratio(r, ref.dense(r), "peak_mib"), "{:.2f}"),
        Column("× faster than 1 proc × 2 thr", lambda r: ratio(ref.single(r), r), "{:.2f}"),
        *ring.TAIL,
    ]
    session.targets = []  # issue 4 set no numeric targets: its headline ratios, for information
    for r in filter(Refs.ring_dilated, rows):
        at = f"{fmt_seq(r.case.seq)} p={r.case.world}"
        if r.case.world > 1 and (mem := ratio(r, ref.p1(r), "peak_mib")) is not None:
            detail = f"{r.peak_mib:.0f} MiB vs {r.peak_mib / mem:.0f} MiB"
            session.targets.append(Target(f"ring dilated memory per rank ÷ p=1, {at}", mem, None, detail))
        if (x := ratio(ref.dense(r), r)) is not None:
            detail = f"{r.fwdbwd_s:.2f} s vs {r.fwdbwd_s * x:.2f} s"
            session.targets.append(Target(f"ring dilated × faster than dense ring, {at}", x, None, detail))
    return driver.markdown_table(rows, columns) + "\n\n" + driver.format_targets(session.targets)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", type=int, nargs="+", help="total sequence lengths, multiples of 64 (default 32K..256K)")
    p.add_argument("--worlds", type=int, nargs="+", help="rank counts (default 1 2 4)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="rows (default all)")


BENCHMARK = driver.Benchmark(
    name="ring_dilated", module="benchmarks.ring_dilated", title="ring dilated attention (issue 4)",
    plan=plan, build=build, report=report, add_args=add_args, label=label,
    plots=lambda s: ring.plot_by_world(s, "ring dilated attention (w=[2K,8K,S], r=[1,4,16]), causal, B1 H8 D64 fp32"),
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(driver.main(BENCHMARK))
