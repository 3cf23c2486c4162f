"""Packed sequences: documents packed into one sequence cost what the documents cost (issue 12; SUITE.md)."""

import torch

import ds_ring
from benchmarks.common import MIB, AttentionFn, Case, case_pairs, useful_gflop
from benchmarks.driver import TIME, Benchmark, Column, Session, find, main, markdown_table, plot_rows, ratio

DOCUMENTS, RATES = 8, (1, 2, 4)
PEERS = {"packed": "one_by_one", "ring_packed": "ring_unpacked"}  # what a packed row is compared with


def build(case: Case, rank: int, timeout_s: float) -> AttentionFn:
    """The case's attention on local shards; documents are ``DOCUMENTS`` equal parts of the global sequence."""

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: object, rates: object) -> torch.Tensor:
        total = q.shape[1] * (case.world if case.group else 1)
        cu = [i * total // DOCUMENTS for i in range(DOCUMENTS + 1)]
        if case.impl == "one_by_one":
            return torch.cat([
                ds_ring.dilated_attention(q[:, a:b], k[:, a:b], v[:, a:b], segs, rates, causal=case.causal)
                for a, b in zip(cu[:-1], cu[1:], strict=True)
            ], dim=1)  # fmt: skip
        cu = torch.tensor(cu, dtype=torch.int32) if case.impl != "ring_unpacked" else None
        if case.impl == "packed":
            return ds_ring.dilated_attention(q, k, v, segs, rates, causal=case.causal, cu_seqlens=cu)
        return ds_ring.ring_dilated_attention(q, k, v, segs, rates, causal=case.causal, cu_seqlens=cu,
                                              timeout_s=timeout_s)  # fmt: skip

    return attn


def flop(case: Case) -> float:
    """Useful GFLOP: the documents' work for packed rows, the whole sequence's for ``ring unpacked``."""
    whole = case.impl == "ring_unpacked"
    return useful_gflop(case, None if whole else DOCUMENTS * case_pairs(case, case.seq // DOCUMENTS))


def plan(session: Session) -> None:
    args = session.args
    for seq in args.seqs:
        for kind in ("dense", "dilated"):
            doc = seq // DOCUMENTS
            segs, rates = (None, None) if kind == "dense" else ((doc // 4, doc // 2, doc), RATES)
            for impl in ("packed", "one_by_one"):
                session.run(Case(impl, seq, threads=args.threads, group=False, segment_lengths=segs,
                                 dilation_rates=rates, warmup_seq=seq // DOCUMENTS, tag=kind))  # fmt: skip
        for impl in ("ring_packed", "ring_unpacked"):
            session.run(Case(impl, seq, world=args.world, tag="ring", warmup_seq=64 * args.world * DOCUMENTS))


def report(session: Session) -> str:
    """Each row against its peer (:data:`PEERS`); the K/V (and gradient) MiB the largest ring rank sent."""
    rows = session.rows
    peer = lambda r: find(rows, impl=PEERS.get(r.case.impl), seq=r.case.seq, tag=r.case.tag)
    return markdown_table(rows, [
        "impl", Column("attention", lambda r: r.case.tag), "seq",
        Column("ranks", lambda r: r.case.world if r.case.group else 1), "fwd+bwd s",
        Column("time ÷ peer", lambda r: ratio(r, peer(r)), "{:.3f}"), "useful GFLOP/s",
        Column("K/V+grad MiB sent per rank", lambda r: r.largest("ring_bytes_sent"), lambda b: f"{b / MIB:.1f}"),
        Column("peak MiB per rank", lambda r: r.peak_mib, "{:.0f}"), "other load %", "notes",
    ])  # fmt: skip


BENCHMARK = Benchmark(
    name="packed", module="benchmarks.packed", title="packed sequences (issue 12)", plan=plan, build=build,
    report=report, seqs=([8192, 32768], [8192]), threads=2,
    add_args=lambda p: p.add_argument("--world", type=int, default=4, help="ranks of the ring rows"),
    plots=lambda s: plot_rows(s, lambda r: r.case.tag, f"packed: {DOCUMENTS} documents, B1 H8 D64 fp32, causal",
                              [TIME]),
    label=lambda case: case.impl.replace("_", " "), flop=flop, calls=2, max_call_s=(300.0, 120.0),
    config=lambda args: {"documents": DOCUMENTS, "batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32",
                         "causal": True, "threads": args.threads, "world": args.world, "rates": RATES},
)  # fmt: skip
if __name__ == "__main__":
    raise SystemExit(main(BENCHMARK))
