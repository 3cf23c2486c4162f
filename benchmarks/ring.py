"""Ring attention on CPU ranks, dense (issue 3) and dilated (issue 4); the rows and goals: ``benchmarks/SUITE.md``."""

from benchmarks import strategies
from benchmarks.common import Case, fmt_seq
from benchmarks.driver import Benchmark, Column, Row, Session, find, main, markdown_table, plot_rows, ratio

IMPLS = ["ring", "ring_zigzag", "allgather", "rap", "ring_dilated", "single_1t", "single_2t"]
TAIL = ["wall ÷ compute", "warm-up err", "other load %", "notes"]  # the last columns of the multi-rank tables


def case_of(name: str, seq: int, p: int) -> Case:
    """The case of a row name on ``p`` ranks; dilated: w = [min(2K, S/16), min(8K, S/4), S], r = [1, 4, 16]."""
    branches = dict(segment_lengths=(min(2048, seq // 16), min(8192, seq // 4), seq), dilation_rates=(1, 4, 16))
    if name.startswith("single"):
        return Case("ds_ring", seq, 1, threads=int(name[-2]), group=False, **branches)
    if name == "ring_dilated":
        return Case("ring", seq, p, **branches)
    zigzag = name.endswith("zigzag") and p > 1  # one rank: one contiguous shard
    return Case(name.removesuffix("_zigzag"), seq, p, layout="zigzag" if zigzag else "contiguous")


def plan(session: Session) -> None:
    for seq in session.args.seqs:
        for name in session.args.impls:
            for p in [1] if name.startswith("single") else session.args.worlds:
                # one rank does not communicate: ring, ring_zigzag, allgather are one row (ring's, else ring_zigzag's)
                if p > 1 or name != "allgather" and (name != "ring_zigzag" or "ring" not in session.args.impls):
                    session.run(case_of(name, seq, p))


def refs(rows: list[Row], r: Row) -> tuple[Row | None, ...]:
    """A ring row's (p = 1, ring-attention-pytorch, dense ring, one process × 2 threads) rows; None where none."""
    c = r.case
    if c.impl not in ("ring", "allgather") or not c.group:
        return None, None, None, None
    p1 = find(rows, impl="ring", seq=c.seq, world=1, segment_lengths=c.segment_lengths)
    if c.segment_lengths is None:
        return p1, find(rows, impl="rap", seq=c.seq, world=c.world), None, None
    layout = "zigzag" if c.world > 1 else "contiguous"
    dense = find(rows, impl="ring", seq=c.seq, world=c.world, segment_lengths=None, layout=layout)
    return p1, None, dense, find(rows, seq=c.seq, group=False, threads=2)


def report(session: Session) -> str:
    ref = lambda i: lambda r: refs(session.rows, r)[i]
    segs = lambda c: f"[{', '.join(map(fmt_seq, c.segment_lengths))}] / {list(c.dilation_rates)}"
    return markdown_table(session.rows, [
        "impl", "seq", "procs × threads", "fwd+bwd s", "tokens/s", "useful GFLOP/s", "peak MiB/rank", "inputs MiB/rank",
        Column("w / r", lambda r: segs(r.case) if r.case.segment_lengths else "dense"),
        Column("mem ÷ p=1", lambda r: ratio(r, ref(0)(r), "peak_mib"), "{:.2f}"),
        Column("speed-up vs p=1", lambda r: ratio(ref(0)(r), r), "{:.2f}"),
        Column("× faster than rap", lambda r: ratio(ref(1)(r), r), "{:.1f}"),
        Column("× faster than dense ring", lambda r: ratio(ref(2)(r), r), "{:.1f}"),
        Column("mem ÷ dense ring", lambda r: ratio(r, ref(2)(r), "peak_mib"), "{:.2f}"),
        Column("× faster than 1 proc × 2 thr", lambda r: ratio(ref(3)(r), r), "{:.2f}"), *TAIL,
    ])  # fmt: skip


BENCHMARK = Benchmark(
    name="ring", module="benchmarks.ring", title="ring attention, dense and dilated (issues 3 and 4)",
    plan=plan, build=strategies.build, report=report, label=strategies.label,
    plots=lambda s: plot_rows(s, lambda r: f"p = {r.case.world} rank{'s' if r.case.world > 1 else ''} × 1 thread",
                              "ring attention, causal, B1 H8 D64 fp32, 1 thread per rank"),
    seqs=([16384, 32768, 65536, 131072, 262144], [8192, 16384]), worlds=[1, 2, 4], impls=IMPLS,
    packages=("ring-attention-pytorch", "deepspeed"),
)  # fmt: skip
if __name__ == "__main__":
    raise SystemExit(main(BENCHMARK))
