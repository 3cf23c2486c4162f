"""Packed sequences: documents packed into one sequence cost what the documents cost (issue 12).

    python -m benchmarks.packed [--quick] [--out DIR]

8 documents of ``seq / 8`` tokens packed into one sequence (``cu_seqlens``), batch 1, 8 heads × 64,
fp32, causal:

- single process (``--threads``, default 2): ``packed`` (one call with ``cu_seqlens``) vs ``one by
  one`` (the same ``ds_ring.dilated_attention`` on each document in turn, outputs concatenated), dense
  and dilated (``w = [doc/4, doc/2, doc]``, ``r = [1, 2, 4]``) — target packed ÷ one-by-one ≤ 1.10;
- ring over ``--world`` ranks (default 4, 1 thread each): ``ring packed`` on the packed sequence vs
  ``ring unpacked``, dense causal attention over the same sequence without documents — the speed-up
  from blocks that share no document being skipped, and the K/V bytes that are not sent.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

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
    main,
    markdown_table,
    pairs_dense,
    pairs_dilated,
    plot_rows,
    ratio,
    useful_gflop,
)

if TYPE_CHECKING:
    from torch import Tensor

DOCUMENTS = 8
RATES = (1, 2, 4)
LABELS = {
    "packed": "packed",
    "one_by_one": "one by one",
    "ring_packed": "ring packed",
    "ring_unpacked": "ring unpacked",
}


def _segments(seq: int) -> tuple[int, ...]:
    doc = seq // DOCUMENTS
    return (doc // 4, doc // 2, doc)


def build(case: Case, rank: int, timeout_s: float) -> AttentionFn:
    """The case's attention on local shards; documents are ``DOCUMENTS`` equal parts of the global sequence."""
    import torch

    import ds_ring

    world = case.world if case.group else 1

    def bounds(q: Tensor) -> list[int]:
        total = q.shape[1] * world
        return [i * total // DOCUMENTS for i in range(DOCUMENTS + 1)]

    def attn(q: Tensor, k: Tensor, v: Tensor, segs: Any, rates: Any) -> Tensor:
        if case.impl == "packed":
            cu = torch.tensor(bounds(q), dtype=torch.int32)
            return ds_ring.dilated_attention(q, k, v, segs, rates, causal=case.causal, cu_seqlens=cu)
        if case.impl == "one_by_one":
            cu = bounds(q)
            return torch.cat(
                [
                    ds_ring.dilated_attention(q[:, a:b], k[:, a:b], v[:, a:b], segs, rates, causal=case.causal)
                    for a, b in zip(cu[:-1], cu[1:], strict=True)
                ],
                dim=1,
            )
        cu = torch.tensor(bounds(q), dtype=torch.int32) if case.impl == "ring_packed" else None
        return ds_ring.ring_dilated_attention(
            q, k, v, segs, rates, causal=case.causal, cu_seqlens=cu, timeout_s=timeout_s
        )

    return attn


def flop(case: Case) -> float:
    """Useful GFLOP: the documents' work for packed rows, the whole sequence's for ``ring unpacked``."""
    if case.impl == "ring_unpacked":
        return useful_gflop(case)
    doc = case.seq // DOCUMENTS
    segs, rates = case.segment_lengths, case.dilation_rates
    per_doc = (
        pairs_dense(doc, case.heads, case.causal)
        if segs is None
        else pairs_dilated(doc, case.heads, segs, rates or (), case.causal)
    )
    return useful_gflop(case, DOCUMENTS * per_doc)


def plan(session: Session) -> None:
    args = session.args
    for seq in args.seqs or ([8192] if args.quick else [8192, 32768]):
        for kind in ("dense", "dilated"):
            segs, rates = (None, None) if kind == "dense" else (_segments(seq), RATES)
            for impl in ("packed", "one_by_one"):
                case = Case(impl, seq, threads=args.threads, group=False, segment_lengths=segs, dilation_rates=rates,
                            warmup_seq=seq // DOCUMENTS, tag=kind)  # fmt: skip
                session.run(case)
        for impl in ("ring_packed", "ring_unpacked"):
            session.run(Case(impl, seq, world=args.world, tag="ring", warmup_seq=64 * args.world * DOCUMENTS))


def _bytes_sent(row: Row) -> float | None:
    sent = [r.get("ring_bytes_sent") for r in row.raw if r.get("ring_bytes_sent") is not None]
    return max(sent) / 2**20 if sent else None


def report(session: Session) -> str:
    rows = session.rows

    def peer(r: Row) -> Row | None:
        other = {"packed": "one_by_one", "ring_packed": "ring_unpacked"}.get(r.case.impl)
        return find(rows, impl=other, seq=r.case.seq, tag=r.case.tag) if other else None

    columns = [
        Column("impl", lambda r: r.label),
        Column("attention", lambda r: r.case.tag),
        Column("seq", lambda r: r.case.seq, fmt_seq),
        Column("ranks", lambda r: r.case.world if r.case.group else 1),
        Column("fwd+bwd s", lambda r: r.fwdbwd_s, "{:.3f}"),
        Column("time ÷ peer", lambda r: ratio(r, peer(r)), "{:.3f}"),
        Column("useful GFLOP/s", lambda r: r.gflops, "{:.1f}"),
        Column("K/V+grad MiB sent per rank", _bytes_sent, "{:.1f}"),
        Column("peak MiB per rank", lambda r: r.peak_mib, "{:.0f}"),
        Column("other load %", lambda r: r.other_cpu_pct, "{:.0f}"),
        Column("notes", lambda r: "; ".join(r.notes)),
    ]
    targets = []
    for r in rows:
        value = ratio(r, peer(r))
        if r.case.impl == "packed" and value is not None:
            targets.append(
                Target(f"packed ÷ one-by-one time, {r.case.tag} {fmt_seq(r.case.seq)}", round(value, 3), value <= 1.10,
                       "target ≤ 1.10")
            )  # fmt: skip
        if r.case.impl == "ring_packed" and value is not None:
            sent, unsent = _bytes_sent(r) or 0.0, _bytes_sent(peer(r)) or 0.0
            targets.append(
                Target(f"ring p={r.case.world} {fmt_seq(r.case.seq)}: packed speed-up over unpacked dense causal",
                       round(1 / value, 2), None, f"{sent:.1f} vs {unsent:.1f} MiB sent per rank")
            )  # fmt: skip
    session.targets = targets
    lines = [f"- {t.target}: {t.value} ({t.detail})" for t in targets]
    return markdown_table(rows, columns) + "\n\n" + "\n".join(lines)


def plots(session: Session) -> None:
    title = f"packed: {DOCUMENTS} documents, B1 H8 D64 fp32, causal"
    plot_rows(
        session.out / "packed_time.png", session.rows, panel=lambda r: r.case.tag, ylabel="fwd+bwd time per call (s)",
        title=title,
    )  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", type=int, nargs="+", help="packed sequence lengths (default 8K 32K, quick 8K)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the single process (default 2)")
    p.add_argument("--world", type=int, default=4, help="ranks of the ring rows (default 4)")


BENCHMARK = Benchmark(
    name="packed", module="benchmarks.packed", title="packed sequences (issue 12)",
    plan=plan, build=build, report=report, plots=plots, add_args=add_args,
    label=lambda case: LABELS[case.impl], flop=flop, calls=2, max_call_s=(300.0, 120.0),
    config=lambda args: {"documents": DOCUMENTS, "batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32",
                         "causal": True, "threads": args.threads, "world": args.world, "rates": RATES},
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(main(BENCHMARK))
