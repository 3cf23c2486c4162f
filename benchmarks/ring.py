"""Dense causal ring attention on CPU ranks: ring vs all-gather vs ``ring-attention-pytorch`` (issue 3).
``python -m benchmarks.ring [--quick] [--out DIR]``; rows, columns and targets: ``benchmarks/SUITE.md``."""

from benchmarks import peers, strategies
from benchmarks.cases import Case
from benchmarks.common import fmt_seq
from benchmarks.driver import Benchmark, Session, main
from benchmarks.rows import Column, Row, Target, compare, find, markdown_table, plot_rows, ratio

IMPLS = {"ring": ("ring", "contiguous"), "ring_zigzag": ("ring", "zigzag"), "allgather": ("allgather", "contiguous"),
         "rap": ("rap", "contiguous"), "torch_cp": ("torch_cp", "contiguous")}  # fmt: skip
# the columns every multi-rank table starts and ends with (benchmarks.rows.COLUMNS)
COLUMNS = ["impl", "seq", "procs × threads", "fwd+bwd s", "tokens/s", "useful GFLOP/s", "peak MiB/rank",
           "inputs MiB/rank"]  # fmt: skip
TAIL = ["wall ÷ compute", "warm-up err", "other load %", "notes"]


def plan(session: Session) -> None:
    for seq in session.args.seqs:
        for p in session.args.worlds:
            for name in session.args.impls:
                if p > 1 or name in ("ring", "rap"):
                    session.run(Case(IMPLS[name][0], seq, p, layout=IMPLS[name][1]))


def p1(rows: list[Row], r: Row) -> Row | None:
    """The p = 1 ds_ring row of ``r``'s length, for ds_ring rows."""
    return find(rows, impl="ring", seq=r.case.seq, world=1) if r.case.impl in ("ring", "allgather") else None


def rap(rows: list[Row], r: Row) -> Row | None:
    """The ring-attention-pytorch row of ``r``'s length and ranks, for the other rows."""
    return find(rows, impl="rap", seq=r.case.seq, world=r.case.world) if r.case.impl != "rap" else None


def targets(session: Session) -> list[Target]:
    out, rows, cores = [], session.rows, session.cores
    for r in rows:
        seq, at = fmt_seq(r.case.seq), f"{fmt_seq(r.case.seq)} p={r.case.world}"
        if r.case.world == 4:
            aside = r.case.impl == "allgather"  # beside ring, no target
            text = f"{r.label} memory per rank at p=4 ≤ 0.30 × p=1, {seq}"
            met = (lambda x: None) if aside else (lambda x: x <= 0.3)
            out += compare(text, r, p1(rows, r), "peak_mib", met, " (beside it, no target)" if aside else "")
        if r.case.world == 2 and r.case.impl == "ring":
            note = "" if cores >= 2 else f" (only {cores} usable core: not meaningful)"
            note += f"; other load {r.other_cpu_pct or 0:.0f}%"
            text = f"{r.label}: 2 ranks on 2 cores ≥ 1.8× faster than 1 rank, {seq}"
            out += compare(text, p1(rows, r), r, met=lambda x: x >= 1.8, note=note)
        if r.case.impl in ("ring", "allgather"):
            text = f"{r.label} ≥ 5× faster than ring-attention-pytorch, {at}"
            out += compare(text, rap(rows, r), r, met=lambda x: x >= 5.0)
    return out


def report(session: Session) -> str:
    rows = session.rows
    return markdown_table(rows, [
        *COLUMNS, Column("mem ÷ p=1", lambda r: ratio(r, p1(rows, r), "peak_mib"), "{:.2f}"),
        Column("speed-up vs p=1", lambda r: ratio(p1(rows, r), r), "{:.2f}"),
        Column("× faster than rap", lambda r: ratio(rap(rows, r), r), "{:.1f}"), *TAIL,
    ])  # fmt: skip


def by_world(r: Row) -> str:
    return f"p = {r.case.world} rank{'s' if r.case.world > 1 else ''} × 1 thread"


BENCHMARK = Benchmark(
    name="ring", module="benchmarks.ring", title="dense causal ring attention (issue 3)",
    plan=plan, build=strategies.build, report=report, targets=targets, label=strategies.label,
    plots=lambda s: plot_rows(s, by_world, "dense causal ring attention, B1 H8 D64 fp32, 1 thread per rank"),
    seqs=([16384, 32768, 65536, 131072], [8192, 16384]), worlds=[1, 2, 4], impls=list(IMPLS),
    efficiency=peers.EFFICIENCY, packages=("ring-attention-pytorch", "deepspeed"),
)  # fmt: skip
if __name__ == "__main__":
    raise SystemExit(main(BENCHMARK))
