"""Ring dilated attention vs dense ring vs single-process dilated attention, on CPU ranks (issue 4).
``python -m benchmarks.ring_dilated [--quick] [--out DIR]``; rows and columns: ``benchmarks/SUITE.md``."""

from benchmarks import ring, strategies
from benchmarks.cases import Case
from benchmarks.common import fmt_seq
from benchmarks.driver import Benchmark, Session, main
from benchmarks.rows import Column, Row, Target, compare, find, markdown_table, plot_rows, ratio


def case_of(name: str, seq: int, p: int) -> Case:
    """The case of a command-line row name: ``ring_dilated``, ``dense_ring``, ``single_1t`` or ``single_2t``."""
    branches = dict(segment_lengths=(min(2048, seq // 16), min(8192, seq // 4), seq), dilation_rates=(1, 4, 16))
    if name == "dense_ring":
        return Case("ring", seq, p, layout="zigzag")
    if name == "ring_dilated":
        return Case("ring", seq, p, **branches)
    return Case("ds_ring", seq, 1, threads=int(name[-2]), group=False, **branches)


def plan(session: Session) -> None:
    for seq in session.args.seqs:
        for name in session.args.impls:
            for p in [1] if name.startswith("single") else session.args.worlds:
                session.run(case_of(name, seq, p))


def refs(rows: list[Row], r: Row) -> tuple[Row | None, Row | None, Row | None]:
    """A row's p = 1 row and, for ring dilated, its dense ring and one process × 2 threads rows."""
    c = r.case
    p1 = find(rows, impl=c.impl, seq=c.seq, layout=c.layout, world=1, threads=c.threads)
    if not (c.group and c.segment_lengths):
        return p1, None, None
    return p1, find(rows, seq=c.seq, world=c.world, layout="zigzag"), find(rows, seq=c.seq, group=False, threads=2)


def targets(session: Session) -> list[Target]:
    """Issue 4 set no numeric targets: its headline ratios (ring dilated rows), for information."""
    out = []
    for r in (r for r in session.rows if r.case.group and r.case.segment_lengths):
        (p1, dense, _), at = refs(session.rows, r), f"{fmt_seq(r.case.seq)} p={r.case.world}"
        out += compare(f"ring dilated memory per rank ÷ p=1, {at}", r, p1, "peak_mib") if r.case.world > 1 else []
        out += compare(f"ring dilated × faster than dense ring, {at}", dense, r)
    return out


def report(session: Session) -> str:
    ref = lambda i: lambda r: refs(session.rows, r)[i]
    segs = lambda c: f"[{', '.join(map(fmt_seq, c.segment_lengths))}] / {list(c.dilation_rates)}"
    return markdown_table(session.rows, [
        *ring.COLUMNS, Column("w / r", lambda r: segs(r.case) if r.case.segment_lengths else "dense"),
        Column("mem ÷ p=1", lambda r: ratio(r, ref(0)(r), "peak_mib"), "{:.2f}"),
        Column("speed-up vs p=1", lambda r: ratio(ref(0)(r), r), "{:.2f}"),
        Column("× faster than dense ring", lambda r: ratio(ref(1)(r), r), "{:.1f}"),
        Column("mem ÷ dense ring", lambda r: ratio(r, ref(1)(r), "peak_mib"), "{:.2f}"),
        Column("× faster than 1 proc × 2 thr", lambda r: ratio(ref(2)(r), r), "{:.2f}"), *ring.TAIL,
    ])  # fmt: skip


BENCHMARK = Benchmark(
    name="ring_dilated", module="benchmarks.ring_dilated", title="ring dilated attention (issue 4)",
    plan=plan, build=strategies.build, report=report, targets=targets, label=strategies.label,
    plots=lambda s: plot_rows(s, ring.by_world, "ring dilated attention (w=[2K,8K,S], r=[1,4,16]), causal, "
                                     "B1 H8 D64 fp32"),
    seqs=([32768, 65536, 131072, 262144], [8192, 16384]), worlds=[1, 2, 4],
    impls=["ring_dilated", "dense_ring", "single_1t", "single_2t"],
)  # fmt: skip
if __name__ == "__main__":
    raise SystemExit(main(BENCHMARK))
