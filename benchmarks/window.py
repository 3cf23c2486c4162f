"""One sliding-window layer's forward+backward in one process, the band kernels side by side (issue 33; SUITE.md)."""

import statistics
import subprocess
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

import ds_ring
from benchmarks.common import AttentionFn, Case, RankResult, attention_rank, figure
from benchmarks.driver import Benchmark, Column, Row, Session, main, markdown_table
from ds_ring.kernels import dilated
from ds_ring.kernels import window as W
from tests.op_count import OpCount

PIECES_REV = "650ed12^"  # the commit before the batched bands: its ds_ring/kernels/window.py is the "pieces" variant
VARIANTS = ("pieces", "batched", "fused")
WINDOW = 128


def build(case: Case, rank: int, timeout_s: float) -> AttentionFn:
    """``case.impl``'s band kernel patched into this rank process; the layer (causal, window :data:`WINDOW`)."""
    if case.impl == "pieces":  # its band functions take options as keywords; the kernels now pass a Piece
        source = subprocess.run(["git", "show", f"{PIECES_REV}:ds_ring/kernels/window.py"], capture_output=True,
                                text=True, check=True).stdout  # fmt: skip
        old = sys.modules["pieces_window"] = types.ModuleType("pieces_window")  # dataclasses look it up
        exec(compile(source, "pieces_window.py", "exec"), old.__dict__)
        adapt = lambda band: lambda *a: band(*a[:-1], d=a[-1].d, window=a[-1].window, scale=a[-1].scale,
                                             softcap=a[-1].softcap)  # fmt: skip
        dilated.attend_band_into = adapt(old.attend_band_into)
        dilated.attend_band_backward = adapt(old.attend_band_backward)
    elif case.impl == "batched":
        W._fused = lambda *args: False
    return lambda q, k, v, segs, rates: ds_ring.dilated_attention(q, k, v, causal=True, window=WINDOW)


@dataclass
class WindowResult(RankResult):
    ops: int | None = None


def window_rank(rank: int, world: int, case: Case, build: Any, calls: int, timeout_s: float) -> WindowResult:
    """:func:`~benchmarks.common.attention_rank`, then the ops one call dispatches (``tests.op_count.OpCount``)."""
    result = WindowResult(**vars(attention_rank(rank, world, case, build, calls, timeout_s)))
    q, k, v, dout = (torch.randn(1, case.seq, case.heads, case.head_dim, requires_grad=i < 3) for i in range(4))
    with OpCount() as ops:
        build(case, rank, timeout_s)(q, k, v, None, None).backward(dout)
    result.ops = ops.total
    return result


def plan(session: Session) -> None:
    for r in range(session.args.rounds):  # the variants' order alternates between rounds
        for impl in session.args.impls if r % 2 == 0 else session.args.impls[::-1]:
            session.run(Case(impl, session.args.seqs[0], threads=2, group=False, warmup_seq=256, tag=f"round {r}"))


median = lambda rows, attr: statistics.median(getattr(r, attr) for r in rows)  # over a variant's rounds


def by_variant(session: Session) -> list[list[Row]]:
    """Per variant with a measured row, its rows (one per round)."""
    return [rs for v in session.args.impls if (rs := [r for r in session.rows if r.case.impl == v and r.fwdbwd_s])]


def report(session: Session) -> str:
    """The median over rounds per variant; extra memory in MiB and in q shards (``[1, S, 8, 64]`` fp32)."""
    q_mib = session.args.seqs[0] * 8 * 64 * 4 / 2**20
    return markdown_table(by_variant(session), [
        Column("variant", lambda rs: rs[0].case.impl), Column("ops", lambda rs: rs[0].raw[0]["ops"], "{:,}"),
        Column("fwd+bwd s, median", lambda rs: median(rs, "fwdbwd_s"), "{:.2f}"),
        Column("each round", lambda rs: ", ".join(f"{r.fwdbwd_s:.2f}" for r in rs)),
        Column("extra MiB", lambda rs: median(rs, "first_extra_mib"), "{:.0f}"),
        Column("q shards", lambda rs: median(rs, "first_extra_mib") / q_mib, "{:.1f}"),
    ])  # fmt: skip


def plots(session: Session) -> None:
    """``window.png``: median fwd+bwd time and extra memory per variant."""
    rows = by_variant(session)
    with figure(session.out / "window.png", 9, 3.5, 2) as axes:
        for ax, attr, ylabel in zip(axes, ("fwdbwd_s", "first_extra_mib"), ("fwd+bwd s", "extra MiB"), strict=True):
            ax.bar([rs[0].case.impl for rs in rows], [median(rs, attr) for rs in rows])
            ax.set(ylabel=ylabel, title=f"window {WINDOW}, {session.args.seqs[0]} tokens, median of rounds")


BENCHMARK = Benchmark(
    name="window", module="benchmarks.window", title=f"one sliding-window layer (window {WINDOW}), fp32, 2 threads",
    plan=plan, build=build, report=report, plots=plots, rank=window_rank, seqs=([16384], [4096]), impls=list(VARIANTS),
    add_args=lambda p: p.add_argument("--rounds", type=int, default=3, help="rounds, the order alternating"),
)  # fmt: skip
if __name__ == "__main__":
    raise SystemExit(main(BENCHMARK))
