"""Sequence-parallel strategies at p = 4: ring, all-gather, Ulysses, hybrid, DeepSpeed's Ulysses (SUITE.md)."""

import functools

import ds_ring
from benchmarks import dilated, peers
from benchmarks.common import AttentionFn, Case
from benchmarks.driver import Benchmark, Column, Session, find, main, markdown_table, plot_rows, ratio

STRATEGIES = ["ring", "allgather", "ulysses", "hybrid"]
NAMES = {"ring": "ring", "allgather": "all-gather", "ulysses": "Ulysses", "hybrid": "hybrid", "dense": "dense SDPA",
         "deepspeed": "DeepSpeed DistributedAttention + SDPA", "rap": "ring-attention-pytorch 0.5.20",
         "ds_ring": "ds_ring.dilated_attention", "dap": "dilated-attention-pytorch 0.2.0"}  # fmt: skip


def label(case: Case) -> str:
    """ds_ring's strategies with their layout (and degrees, branches), the others by name; one process's threads."""
    name = NAMES[case.impl]
    if case.impl in STRATEGIES:
        degrees = f" U{case.ulysses}×R{case.world // case.ulysses}" if case.impl == "hybrid" else ""
        name = f"ds_ring {name}{degrees}{' dilated' if case.segment_lengths else ''} ({case.layout})"
    return name if case.group else f"{name}, 1 process × {case.threads} thread{'s' if case.threads > 1 else ''}"


def build(case: Case, rank: int, timeout_s: float) -> AttentionFn:
    """ds_ring's strategy or a peer over the case's ranks; one-process cases: :func:`dilated.build`."""
    if not case.group:
        return dilated.build(case, rank, timeout_s)
    if case.impl == "rap":
        return peers.rap_attention(case)
    ring = case.world // (case.data * case.ulysses)
    topology = ds_ring.Topology(data_parallel=case.data, ulysses=case.ulysses, ring=ring, timeout_s=timeout_s)
    if case.impl == "deepspeed":
        return peers.deepspeed_attention(case, rank, topology.sequence_parallel_group)
    kwargs = dict(causal=case.causal, topology=topology, strategy=case.impl, layout=case.layout)
    return functools.partial(ds_ring.sequence_parallel_attention, **kwargs)  # (q, k, v, segs, rates)


def plan(session: Session) -> None:
    for seq in session.args.seqs:
        for attention, causal in [("dense", False), ("dense", True), ("dilated", True)]:
            segs, rates = ((seq // 8, seq // 2, seq), (1, 2, 4)) if attention == "dilated" else (None, None)
            for impl in session.args.impls:
                session.run(Case(impl, seq, 4, ulysses=2, causal=causal, segment_lengths=segs, dilation_rates=rates,
                                 fwd=True, tag=attention))  # fmt: skip


def report(session: Session) -> str:
    peer = lambda impl, r: find(session.rows, impl=impl, seq=r.case.seq, tag=r.case.tag, causal=r.case.causal)
    return markdown_table(session.rows, [
        "impl", "seq", Column("attention", lambda r: r.case.tag), "causal", "procs × threads", "fwd s", "fwd+bwd s",
        Column("fwd peak MiB/rank", lambda r: r.fwd_peak_mib, "{:.1f}"),
        Column("fwd+bwd peak MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
        Column("fwd+bwd ÷ ring", lambda r: ratio(r, peer("ring", r)), "{:.2f}"),
        Column("fwd+bwd ÷ DeepSpeed", lambda r: ratio(r, peer("deepspeed", r)), "{:.2f}"), "warm-up err",
        "other load %", "notes",
    ])  # fmt: skip


BENCHMARK = Benchmark(
    name="strategies", module="benchmarks.strategies", title="sequence-parallel strategies, p = 4, Ulysses 2 × ring 2",
    plan=plan, build=build, report=report, label=label, packages=("deepspeed",), calls=3,
    seqs=([4096, 8192, 16384], [2048]), impls=[*STRATEGIES, "deepspeed"],
    plots=lambda s: plot_rows(s, lambda r: f"{r.case.tag}, {'causal' if r.case.causal else 'non-causal'}",
                                     "p=4 (4 processes × 1 thread), U2×R2, B1 H8 D64 fp32", logy=False),
)  # fmt: skip
if __name__ == "__main__":
    raise SystemExit(main(BENCHMARK))
