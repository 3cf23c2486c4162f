"""Single-process dilated attention, ds_ring vs dense SDPA vs dilated-attention-pytorch (issue 2; README.md)."""

import ds_ring
from benchmarks import peers
from benchmarks.common import AttentionFn, Case
from benchmarks.driver import Benchmark, Column, Session, find, main, markdown_table, plot_rows, ratio

SEGMENT_LENGTHS, DILATION_RATES = (2048, 4096, 8192), (1, 2, 4)
LABELS = {"ds_ring": "ds_ring", "dense": "dense SDPA", "dap": "dilated-attention-pytorch 0.2.0"}
MATMUL_N = 4096  # the "% matmul" ceiling: fp32 n×n matmul with the cases' threads, best of the run's start and end


def build(case: Case, rank: int, timeout_s: float) -> AttentionFn:
    """``ds_ring``, ``dense`` or ``dap`` in this process (no process group); also the suite's single-process rows."""
    if case.impl == "dap":
        return peers.dap_attention(case)
    if case.impl == "dense":
        return lambda q, k, v, segs, rates: peers.sdpa(q, k, v, case.causal)
    return lambda q, k, v, segs, rates: ds_ring.dilated_attention(q, k, v, segs, rates, causal=case.causal)


def plan(session: Session) -> None:
    args = session.args
    session.matmul(args.threads, MATMUL_N, "start")
    for seq in args.seqs:
        for causal in (False, True):
            for impl in args.impls:
                segs, rates = (None, None) if impl == "dense" else (SEGMENT_LENGTHS, DILATION_RATES)
                warmup_seq = max(SEGMENT_LENGTHS) if impl == "dap" else None  # dap has no dense attention
                session.run(Case(impl, seq, threads=args.threads, causal=causal, segment_lengths=segs,
                                 dilation_rates=rates, group=False, fwd=True, warmup_seq=warmup_seq))  # fmt: skip
    session.matmul(args.threads, MATMUL_N, "end")


def report(session: Session) -> str:
    rows = session.rows
    ceiling = max((v or 0.0) for k, v in session.matmul_gflops.items() if k.startswith(f"n={MATMUL_N} "))
    peer = lambda impl: lambda r: find(rows, impl=impl, seq=r.case.seq, causal=r.case.causal)
    fwd_per_s = lambda r: r.useful_gflop / 3.5 / r.fwd_s if r.fwd_s else None  # the forward: 1/3.5 of the flop
    columns = [
        "impl", "seq", "causal", "fwd s", "fwd+bwd s",
        Column("fwd peak extra MiB", lambda r: r.fwd_first_extra_mib, "{:.0f}"),
        Column("fwd+bwd peak extra MiB", lambda r: r.first_extra_mib, "{:.0f}"),
        Column("useful GFLOP (fwd)", lambda r: r.useful_gflop / 3.5, "{:.1f}"),
        Column("fwd GFLOP/s", fwd_per_s, "{:.1f}"), Column("fwd+bwd GFLOP/s", lambda r: r.gflops, "{:.1f}"),
        Column("% matmul", lambda r: 100 * r.gflops / ceiling if r.gflops and ceiling else None, "{:.0f}%"),
        Column("fwd+bwd time ÷ dense", lambda r: ratio(r, peer("dense")(r)), "{:.3f}"),
        Column("fwd+bwd time ÷ dap", lambda r: ratio(r, peer("dap")(r)), "{:.2f}"),
        Column("work ÷ dap", lambda r: ratio(r, peer("dap")(r), "useful_gflop"), "{:.2f}"), "other load %", "notes",
    ]  # fmt: skip
    head = f"{session.args.threads} threads, fp32 matmul {MATMUL_N}²: {ceiling:.1f} GFLOP/s."
    return head + "\n\n" + markdown_table(rows, columns)


def plots(session: Session) -> None:
    phases = lambda fwdbwd, fwd: [("fwd+bwd", fwdbwd, "-o"), ("fwd", fwd, "--^")]
    figures = [("time", "time per call (s)", phases(lambda r: r.fwdbwd_s, lambda r: r.fwd_s)),
               ("memory", "peak RSS above baseline (MiB)", phases(lambda r: r.first_extra_mib,
                                                                  lambda r: r.fwd_first_extra_mib))]  # fmt: skip
    branches = f"w={list(SEGMENT_LENGTHS)} r={list(DILATION_RATES)}"
    title = f"dilated attention, B1 H8 D64 fp32, {session.args.threads} threads, {branches}"
    plot_rows(session, lambda r: "causal" if r.case.causal else "non-causal", title, figures)


BENCHMARK = Benchmark(
    name="dilated", module="benchmarks.dilated", title="single-process dilated attention (issue 2)",
    plan=plan, build=build, report=report, plots=plots, threads=2, label=lambda case: LABELS[case.impl],
    seqs=([8192, 16384, 32768, 65536], [8192, 16384]), impls=list(LABELS), flop=peers.flop,
    packages=("dilated-attention-pytorch", "deepspeed"), calls=3, max_call_s=(150.0, 60.0),
    config=lambda args: {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32", "threads": args.threads,
                         "segment_lengths": SEGMENT_LENGTHS, "dilation_rates": DILATION_RATES},
)  # fmt: skip
if __name__ == "__main__":
    raise SystemExit(main(BENCHMARK))
