"""Sequence-parallel strategies at p = 4: ring vs allgather vs ulysses vs hybrid vs DeepSpeed Ulysses.

    python -m benchmarks.strategies [--quick] [--out DIR]

Four ranks (processes, :mod:`benchmarks.ranks`), one torch thread each, gloo over loopback,
topology ulysses 2 × ring 2 (``ring``, ``allgather`` and ``ulysses`` use the whole
sequence-parallel group of 4; ``hybrid`` all-to-alls inside pairs and rings across them). On a
2-core machine the 4 ranks share 2 cores, so the times include time-slicing: compare strategies
with each other, not with one process.

Shapes: batch 1, 8 heads, head_dim 64, fp32; sequence 4K..16K (``--quick``: 2K); dense attention
causal and non-causal, and LongNet dilated attention (``segment_lengths=[S/8, S/2, S]``,
``dilation_rates=[1, 2, 4]``, causal).

Implementations (every one gets the same local shards ``[1, S/4, 8, 64]``, contiguous, and
returns the local output shard):

``ring`` / ``allgather`` / ``ulysses`` / ``hybrid``
    ``ds_ring.sequence_parallel_attention(..., strategy=...)`` (``hybrid`` with ``communication="ring"``).
``deepspeed``
    ``deepspeed.sequence.layer.DistributedAttention`` (DeepSpeed's own Ulysses: three all-to-alls
    in, one out) over the same group of 4, with ``torch.nn.functional.scaled_dot_product_attention``
    as its local attention. Dense only (SDPA has no dilation).

Each (implementation, sequence, attention) configuration starts 4 fresh rank processes that make
the same fixed number of calls: one small dense warm-up call (its output checked against
``ds_ring.ring_dilated_attention`` on the same shards: ``warm-up err``), then ``--calls``
forward calls (``no_grad``) and ``--calls`` forward+backward calls. The table shows the
slowest rank's median time (every rank waits for the slowest in the collectives) and the largest
per-rank working memory (peak RSS above the RSS before the rank's shards existed); the JSON has
every rank's numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import Column, Series, Skip, fmt_seq, markdown_table, plot_panels, write_json
from benchmarks.ranks import AttentionFn, Throughput, base_report, finish_report, format_header
from benchmarks.ring import BATCH, HEAD_DIM, HEADS, add_common_args, label_rows, resolve_common_args, run_row

if TYPE_CHECKING:
    from torch import Tensor

MODULE = "benchmarks.strategies"
WORLD, ULYSSES, RING = 4, 2, 2
FULL_SEQS = [4096, 8192, 16384]
QUICK_SEQS = [2048]
IMPLS = ["ring", "allgather", "ulysses", "hybrid", "deepspeed"]
ATTENTIONS = [("dense", False), ("dense", True), ("dilated", True)]
LABELS = {
    "ring": "ds_ring ring",
    "allgather": "ds_ring allgather",
    "ulysses": "ds_ring ulysses",
    "hybrid": "ds_ring hybrid",
    "deepspeed": "DeepSpeed DistributedAttention + SDPA",
}
COLORS = {
    "ring": "tab:blue",
    "allgather": "tab:orange",
    "ulysses": "tab:green",
    "hybrid": "tab:purple",
    "deepspeed": "tab:red",
}


def branches(kind: str, seq: int) -> tuple[list[int] | None, list[int] | None]:
    """``(segment_lengths, dilation_rates)``: ``None`` for dense; every segment suits shards of S/4 and S/2."""
    return (None, None) if kind == "dense" else ([seq // 8, seq // 2, seq], [1, 2, 4])


# --------------------------------------------------------------------------------------
# Rank side: the factory benchmarks.ranks.attention_rank calls
# --------------------------------------------------------------------------------------


def make_attention(cfg: dict[str, Any], rank: int, world: int) -> AttentionFn:
    """``attn(q, k, v, segment_lengths, dilation_rates) -> out`` on local shards for ``cfg["impl"]``.

    ``cfg["ulysses"]`` × ``cfg["ring"]`` = ``world`` is the topology; ``cfg["layout"]`` the shards' layout.
    """
    import ds_ring

    topology = ds_ring.Topology(ulysses=cfg["ulysses"], ring=cfg["ring"])
    impl, causal, layout, timeout = cfg["impl"], cfg["causal"], cfg["layout"], cfg["comm_timeout_s"]
    if impl == "deepspeed":
        return _deepspeed_ulysses(topology, causal, rank)

    def attn(q: Tensor, k: Tensor, v: Tensor, segs: list[int] | None, rates: list[int] | None) -> Tensor:
        return ds_ring.sequence_parallel_attention(
            q, k, v, segs, rates, causal=causal, topology=topology, strategy=impl,
            communication="ring", layout=layout, timeout_s=timeout,
        )  # fmt: skip

    return attn


def _deepspeed_ulysses(topology: Any, causal: bool, rank: int) -> AttentionFn:
    """DeepSpeed's ``DistributedAttention`` over the sequence-parallel group, SDPA inside."""
    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
    except ImportError as exc:
        raise Skip(f"deepspeed not importable: {exc}") from exc
    import torch.nn.functional as F

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed(dist_backend="gloo")

    def sdpa(
        q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any
    ) -> Tensor:  # [B, S, h, D] as DistributedAttention passes it
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    # Batch-first [B, S, H, D]: scatter heads (2), gather sequence (1).
    ds_attn = DistributedAttention(sdpa, topology.sequence_parallel_group, scatter_idx=2, gather_idx=1)

    def attn(q: Tensor, k: Tensor, v: Tensor, segs: list[int] | None, rates: list[int] | None) -> Tensor:
        if segs is not None:
            raise ValueError("SDPA, DistributedAttention's local attention here, has no dilation")
        return ds_attn(q, k, v, 0)

    return attn


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def run_strategy(
    impl: str,
    seq: int,
    world: int,
    args: argparse.Namespace,
    throughput: Throughput,
    seen: dict,
    *,
    attention: str = "dense",
    causal: bool = True,
    ulysses: int = 1,
    layout: str = "contiguous",
    fwd: bool = False,
    key: str | None = None,
    calls: int | None = None,
) -> dict[str, Any]:
    """One row: ``impl`` on ``world`` ranks with topology ``ulysses × (world / ulysses)``.

    ``calls`` overrides the number of timed calls. Also used by the suite (``python -m benchmarks``).
    """
    segs, rates = branches(attention, seq)
    key = key or impl
    if impl == "deepspeed" and segs is not None:
        reason = "SDPA, DistributedAttention's local attention here, has no dilation"
        return {"impl": key, "seq": seq, "world": world, "threads_per_rank": 1, "causal": causal,
                "skipped": reason, "notes": "skipped: " + reason}  # fmt: skip
    if world % ulysses:
        reason = f"{world} ranks do not split into ulysses {ulysses} × ring"
        return {"impl": key, "seq": seq, "world": world, "threads_per_rank": 1, "causal": causal,
                "skipped": reason, "notes": "skipped: " + reason}  # fmt: skip
    return run_row(
        impl,
        seq,
        world,
        args,
        throughput,
        seen,
        segment_lengths=segs,
        dilation_rates=rates,
        factory=f"{MODULE}:make_attention",
        layout=layout,
        extra_cfg={"ulysses": ulysses, "ring": world // ulysses, "layout": layout},
        key=key,
        causal=causal,
        fwd=fwd,
        calls=calls,
    )


def _derive(rows: list[dict[str, Any]]) -> None:
    """Time ratios against ring and against DeepSpeed's Ulysses (same seq and attention), in place."""
    by_key = {(r["impl"], r["seq"], r["attention"], r["causal"]): r for r in rows}
    for r in rows:
        for ref in ("ring", "deepspeed"):
            other = by_key.get((ref, r["seq"], r["attention"], r["causal"]), {})
            a, b = r.get("fwdbwd_s"), other.get("fwdbwd_s")
            r[f"fwdbwd_vs_{ref}"] = a / b if a and b else None


COLUMNS = [
    Column("label", "impl"),
    Column("seq", "seq", fmt_seq),
    Column("attention", "attention"),
    Column("causal", "causal", lambda c: "yes" if c else "no"),
    Column("procs", "procs × threads"),
    Column("fwd_s", "fwd s", "{:.3f}"),
    Column("fwdbwd_s", "fwd+bwd s", "{:.3f}"),
    Column("fwd_peak_mib", "fwd peak MiB/rank", "{:.1f}"),
    Column("peak_mib", "fwd+bwd peak MiB/rank", "{:.1f}"),
    Column("fwdbwd_vs_ring", "fwd+bwd ÷ ring", "{:.2f}"),
    Column("fwdbwd_vs_deepspeed", "fwd+bwd ÷ DeepSpeed", "{:.2f}"),
    Column("warmup_max_abs_err", "warm-up err", "{:.1e}"),
    Column("other_cpu_pct", "other load %", "{:.0f}"),
    Column("notes", "notes"),
]


def _plots(out: Path, rows: list[dict[str, Any]], seqs: list[int]) -> list[Path]:
    """``strategies_time.png`` and ``strategies_memory.png``: one panel per attention kind (fwd+bwd)."""
    paths = []
    for name, key, ylabel in (
        ("strategies_time.png", "fwdbwd_s", "fwd+bwd time per call, slowest rank (s)"),
        ("strategies_memory.png", "peak_mib", "fwd+bwd peak working memory, largest rank (MiB)"),
    ):
        panels = []
        for attention, causal in ATTENTIONS:
            series = []
            for impl in IMPLS:
                got = {
                    r["seq"]: r.get(key)
                    for r in rows
                    if (r["impl"], r["attention"], r["causal"]) == (impl, attention, causal)
                }
                if any(v is not None for v in got.values()):
                    ys = [got.get(s) for s in seqs]
                    series.append(Series(LABELS[impl], list(seqs), ys, "-o", {"color": COLORS[impl]}))
            if series:
                panels.append((f"{attention}, {'causal' if causal else 'non-causal'}", series))
        title = f"p={WORLD} ({WORLD} processes × 1 thread), U{ULYSSES}×R{RING}, B{BATCH} H{HEADS} D{HEAD_DIM} fp32"
        if panels:
            paths.append(
                plot_panels(
                    out / name, panels, xlabel="sequence length", ylabel=ylabel, title=title, xticks=seqs, logy=False
                )
            )
    return paths


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration (4 fresh rank processes each); write JSON and PNGs; return the report."""
    seqs = args.seqs or (QUICK_SEQS if args.quick else FULL_SEQS)
    impls = args.impls or IMPLS
    out = Path(args.out)
    t0 = time.perf_counter()
    report = base_report(
        "strategies",
        args,
        {
            "world": WORLD,
            "ulysses": ULYSSES,
            "ring": RING,
            "threads_per_rank": 1,
            "batch": BATCH,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "layout": "contiguous",
            "seqs": seqs,
            "impls": impls,
            "attentions": [f"{a} {'causal' if c else 'non-causal'}" for a, c in ATTENTIONS],
            "dilated_branches": "segment_lengths=[S/8, S/2, S], dilation_rates=[1, 2, 4]",
            "calls": args.calls,
            "time_statistic": "slowest rank's median of the timed calls (after one small dense warm-up call)",
            "memory_statistic": "largest rank's peak RSS above its RSS before its input shards existed",
            "fwd": "forward under torch.no_grad()",
            "fwdbwd": "forward with requires_grad shards + backward(random grad_out shard)",
        },
        ["deepspeed"],
    )
    cores = report["machine"]["usable_cpus"]
    mm = report["matmul"]["1_thread"].get("gflops_best") or 50.0
    throughput = Throughput(cores, mm)
    seen: dict[tuple[str, int], tuple[int, float]] = {}
    rows: list[dict[str, Any]] = report["rows"]
    for seq in seqs:
        for attention, causal in ATTENTIONS:
            for impl in impls:
                row = run_strategy(
                    impl,
                    seq,
                    WORLD,
                    args,
                    throughput,
                    seen,
                    attention=attention,
                    causal=causal,
                    ulysses=ULYSSES,
                    fwd=True,
                )
                row["attention"] = attention
                rows.append(row)
                print(
                    f"  {LABELS[impl]:>38} {fmt_seq(seq):>4} {attention:>7} causal={causal!s:5} "
                    f"fwd={row.get('fwd_s', float('nan')):.3f}s fwd+bwd={row.get('fwdbwd_s', float('nan')):.3f}s "
                    f"peak={row.get('peak_mib', float('nan')):.0f}MiB {row['notes']}",
                    flush=True,
                )
                write_json(out / "strategies.json", report)  # partial results survive an interrupted run
    _derive(rows)
    label_rows(rows, LABELS, cores)
    finish_report(report, t0)
    write_json(out / "strategies.json", report)
    _plots(out, rows, seqs)
    return report


def format_report(report: dict[str, Any]) -> str:
    """Markdown: a header (machine, processes × threads) and the results table."""
    head = format_header(report, f"sequence-parallel strategies, p = {WORLD}, topology ulysses {ULYSSES} × ring {RING}")
    return head + "\n\n" + markdown_table(report["rows"], COLUMNS)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.strategies", description=__doc__.split("\n")[0])
    add_common_args(p, calls=3)
    p.add_argument("--seqs", type=int, nargs="+", help="override the sequence lengths (multiples of 64)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="override the implementations")
    args = p.parse_args(argv)
    resolve_common_args(args, calls=3)
    report = drive(args)
    print()
    print(format_report(report))
    print(f"\nwrote {Path(args.out) / 'strategies.json'}, strategies_time.png, strategies_memory.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
