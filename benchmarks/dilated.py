"""Single-process dilated attention: ds_ring vs dense SDPA vs ``dilated-attention-pytorch`` (issue 2).

    python -m benchmarks.dilated [--quick] [--out DIR]

Batch 1, 8 heads, head_dim 64, fp32, 2 threads, LongNet branches ``w = [2048, 4096, 8192]``,
``r = [1, 2, 4]``, sequence 8K..64K (``--quick``: 8K, 16K), causal and non-causal; each case in a
fresh process that times the forward (``no_grad``) and the forward+backward within ``--budget-s``
per phase, the first call of each phase being its warm-up and its memory measurement
(``benchmarks/README.md``). ``ds_ring``: ``ds_ring.dilated_attention`` (every head computes every
branch); ``dense``: SDPA over the whole sequence; ``dap``: dilated-attention-pytorch 0.2.0, which
splits the heads among the branches (~1/3 of the work: the ``work ÷ dap`` column says how much).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from benchmarks import driver, peers
from benchmarks.driver import Case, Column, Row, Session, find, fmt_seq, ratio

if TYPE_CHECKING:
    from torch import Tensor

SEGMENT_LENGTHS, DILATION_RATES = (2048, 4096, 8192), (1, 2, 4)
IMPLS = ["ds_ring", "dense", "dap"]
LABELS = {"ds_ring": "ds_ring", "dense": "dense SDPA", "dap": "dilated-attention-pytorch 0.2.0"}
MATMUL_N = 4096
"""The ``% matmul`` ceiling: fp32 ``n×n`` matmul with the cases' threads, best of the start and end of the run."""


def build(case: Case, rank: int, timeout_s: float) -> driver.AttentionFn:
    """``ds_ring``, ``dense`` or ``dap`` in this process (no process group); also the suite's single-process rows."""
    if case.impl == "dap":
        return peers.dap_attention(case)
    import torch.nn.functional as F

    import ds_ring

    def attn(q: Tensor, k: Tensor, v: Tensor, segs: Any, rates: Any) -> Tensor:
        if case.impl == "ds_ring":
            return ds_ring.dilated_attention(q, k, v, segs, rates, causal=case.causal)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=case.causal)
        return out.transpose(1, 2)

    return attn


def plan(session: Session) -> None:
    args = session.args
    session.matmul(args.threads, MATMUL_N, "start")
    for seq in args.seqs or ([8192, 16384] if args.quick else [8192, 16384, 32768, 65536]):
        for causal in (False, True):
            for impl in args.impls or IMPLS:
                segs, rates = (None, None) if impl == "dense" else (SEGMENT_LENGTHS, DILATION_RATES)
                case = Case(impl, seq, threads=args.threads, causal=causal, segment_lengths=segs, dilation_rates=rates)
                session.run(dataclasses.replace(case, group=False, fwd=True))
    session.matmul(args.threads, MATMUL_N, "end")


def report(session: Session) -> str:
    rows, threads = session.rows, session.args.threads
    ceiling = max((v or 0.0) for k, v in session.matmul_gflops.items() if k.startswith(f"n={MATMUL_N} "))

    def peer(impl: str) -> Any:
        return lambda r: find(rows, impl=impl, seq=r.case.seq, causal=r.case.causal)

    def per_s(r: Row, phase: str) -> float | None:
        t = r.fwd_s if phase == "fwd" else r.fwdbwd_s
        return r.useful_gflop / (3.5 if phase == "fwd" else 1.0) / t if t else None

    columns = [
        Column("impl", lambda r: r.label),
        Column("seq", lambda r: r.case.seq, fmt_seq),
        Column("causal", lambda r: "yes" if r.case.causal else "no"),
        Column("fwd s", lambda r: r.fwd_s, "{:.3f}"),
        Column("fwd+bwd s", lambda r: r.fwdbwd_s, "{:.3f}"),
        Column("fwd peak extra MiB", lambda r: r.fwd_first_extra_mib, "{:.0f}"),
        Column("fwd+bwd peak extra MiB", lambda r: r.first_extra_mib, "{:.0f}"),
        Column("useful GFLOP (fwd)", lambda r: r.useful_gflop / 3.5, "{:.1f}"),
        Column("fwd GFLOP/s", lambda r: per_s(r, "fwd"), "{:.1f}"),
        Column("fwd+bwd GFLOP/s", lambda r: per_s(r, "fwdbwd"), "{:.1f}"),
        Column(
            "% matmul",
            lambda r: 100 * per_s(r, "fwdbwd") / ceiling if per_s(r, "fwdbwd") and ceiling else None,
            "{:.0f}%",
        ),
        Column("fwd+bwd time ÷ dense", lambda r: ratio(r, peer("dense")(r)), "{:.3f}"),
        Column("fwd+bwd time ÷ dap", lambda r: ratio(r, peer("dap")(r)), "{:.2f}"),
        Column("work ÷ dap", lambda r: ratio(r, peer("dap")(r), "useful_gflop"), "{:.2f}"),
        Column("other load %", lambda r: r.other_cpu_pct, "{:.0f}"),
        Column("notes", lambda r: "; ".join(r.notes)),
    ]
    return f"{threads} threads, fp32 matmul {MATMUL_N}²: {ceiling:.1f} GFLOP/s.\n\n" + driver.markdown_table(
        rows, columns
    )


def plots(session: Session) -> None:
    branches = f"w={list(SEGMENT_LENGTHS)} r={list(DILATION_RATES)}"
    title = f"dilated attention, B1 H8 D64 fp32, {session.args.threads} threads, {branches}"
    panel = lambda r: "causal" if r.case.causal else "non-causal"
    for name, ylabel, fwdbwd, fwd in (
        ("time", "time per call (s)", lambda r: r.fwdbwd_s, lambda r: r.fwd_s),
        ("memory", "peak RSS above baseline (MiB)", lambda r: r.first_extra_mib, lambda r: r.fwd_first_extra_mib),
    ):
        phases = (("fwd+bwd", fwdbwd, "-o"), ("fwd", fwd, "--^"))
        driver.plot_rows(
            session.out / f"dilated_{name}.png", session.rows, panel=panel, ylabel=ylabel, title=title, phases=phases
        )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default 8K..64K, quick 8K 16K)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="implementations (default all)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the process (default 2)")


BENCHMARK = driver.Benchmark(
    name="dilated", module="benchmarks.dilated", title="single-process dilated attention (issue 2)",
    plan=plan, build=build, report=report, plots=plots, add_args=add_args,
    label=lambda case: LABELS[case.impl], flop=peers.flop, packages=("dilated-attention-pytorch", "deepspeed"),
    calls=3, max_call_s=(150.0, 60.0), budget_s=(30.0, 8.0),
    config=lambda args: {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32", "threads": args.threads,
                         "segment_lengths": SEGMENT_LENGTHS, "dilation_rates": DILATION_RATES},
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(driver.main(BENCHMARK))
