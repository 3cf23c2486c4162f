"""Ring dilated attention vs dense ring vs single-process dilated attention, on CPU ranks (issue 4).

    python -m benchmarks.ring_dilated [--quick] [--out DIR]

Per-rank peak memory and forward+backward time, causal, batch 1, 8 heads, head_dim 64, fp32, total
sequence 32K..256K (``--quick``: 8K, 16K), p = 1, 2, 4 ranks (processes) × 1 torch thread, gloo
over loopback (:mod:`benchmarks.ranks`). On 2 cores p = 4 time-shares the cores.

LongNet branches scale with the sequence: ``segment_lengths = [min(2048, S/16), min(8192, S/4), S]``,
``dilation_rates = [1, 4, 16]`` (32K: ``[2048, 8192, 32768]``; 256K: ``[2048, 8192, 262144]``; quick
8K: ``[512, 2048, 8192]``). With shards of ``L = S/p`` tokens the short branches are local to a rank
and the ``S`` branch spans all ranks, passing only every 16th K/V row (DESIGN §2).

Rows:

``ring_dilated``
    ``ds_ring.ring_dilated_attention(..., communication="ring", layout="contiguous")`` with the branches above.
``dense_ring``
    the same call with dense attention (``segment_lengths=None``) and ``layout="zigzag"`` (balanced).
``single``
    ``ds_ring.dilated_attention`` in one process without a process group, 1 and 2 threads.

Memory per rank is measured in each rank's fresh process (working memory: peak RSS above the RSS
before its shards existed). Rows that are infeasible on this machine — one call estimated above
``--max-call-s`` from the GFLOP/s measured so far, or more memory than is available — are
recorded as skipped with the estimate (e.g. dense ring at 256K: ~250 TFLOP of useful work).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import Column, fmt_seq, markdown_table, write_json
from benchmarks.ranks import AttentionFn, Throughput, base_report, finish_report, format_header, format_targets
from benchmarks.ring import (
    BATCH,
    HEAD_DIM,
    HEADS,
    add_common_args,
    label_rows,
    plots,
    resolve_common_args,
    run_row,
)

if TYPE_CHECKING:
    from torch import Tensor

MODULE = "benchmarks.ring_dilated"
FULL_SEQS = [32768, 65536, 131072, 262144]
QUICK_SEQS = [8192, 16384]
WORLDS = [1, 2, 4]
DILATION_RATES = [1, 4, 16]
IMPLS = ["ring_dilated", "dense_ring", "single_1t", "single_2t"]
LABELS = {
    "ring_dilated": "ds_ring ring dilated",
    "dense_ring": "ds_ring dense ring (zigzag)",
    "single_1t": "ds_ring.dilated_attention, 1 process × 1 thread",
    "single_2t": "ds_ring.dilated_attention, 1 process × 2 threads",
}
COLORS = {"ring_dilated": "tab:blue", "dense_ring": "tab:red", "single_1t": "tab:green", "single_2t": "tab:olive"}


def branches(seq: int) -> tuple[list[int], list[int]]:
    """``(segment_lengths, dilation_rates)`` for a total sequence of ``seq`` tokens (see the module doc)."""
    return [min(2048, seq // 16), min(8192, seq // 4), seq], list(DILATION_RATES)


def make_single(cfg: dict[str, Any], rank: int, world: int) -> AttentionFn:
    """Factory for :func:`benchmarks.ranks.attention_rank`: single-process attention in this process.

    ``cfg["single_impl"]`` (default ``"ds_ring"``) names a ``benchmarks.dilated`` implementation:
    ``ds_ring`` (``ds_ring.dilated_attention``), ``dense`` (SDPA over the whole sequence) or ``dap``
    (dilated-attention-pytorch with its xformers call mapped to SDPA), built by
    ``benchmarks.dilated``'s own constructor for the branches of each call.
    """
    from benchmarks.dilated import _attention_fn

    impl = cfg.get("single_impl", "ds_ring")
    built: dict[tuple, Any] = {}

    def attn(q: Tensor, k: Tensor, v: Tensor, segs: list[int] | None, rates: list[int] | None) -> Tensor:
        key = (q.shape[1], tuple(segs or ()), tuple(rates or ()))
        if key not in built:
            built[key] = _attention_fn(impl, dict(cfg, seq=q.shape[1], segment_lengths=segs, dilation_rates=rates))
        return built[key](q, k, v)

    return attn


def planned(seqs: list[int], worlds: list[int], impls: list[str]) -> list[tuple[int, int, str]]:
    """(seq, p, impl) in run order; the single-process rows run once per seq (p = 1)."""
    rows = []
    for seq in seqs:
        for impl in impls:
            ps = [1] if impl.startswith("single") else worlds
            rows += [(seq, p, impl) for p in ps]
    return rows


def run_planned(
    seq: int, p: int, impl: str, args: argparse.Namespace, throughput: Throughput, seen: dict
) -> dict[str, Any]:
    """One row: launch the ranks (or the single process) for ``impl`` at ``seq`` on ``p`` ranks."""
    segs, rates = branches(seq)
    if impl == "ring_dilated":
        return run_row(
            "ring",
            seq,
            p,
            args,
            throughput,
            seen,
            segment_lengths=segs,
            dilation_rates=rates,
            layout="contiguous",
            key=impl,
        )
    if impl == "dense_ring":
        return run_row("ring_zigzag", seq, p, args, throughput, seen, layout="zigzag", key=impl)
    threads = 1 if impl == "single_1t" else 2
    return run_row(
        "single",
        seq,
        1,
        args,
        throughput,
        seen,
        segment_lengths=segs,
        dilation_rates=rates,
        factory=f"{MODULE}:make_single",
        threads=threads,
        distributed=False,
        key=impl,
    )


def derive(rows: list[dict[str, Any]]) -> None:
    """Ratios: against the same impl at p = 1, ring dilated against dense ring and the single process."""
    by = {(r["impl"], r["seq"], r["world"]): r for r in rows}
    for r in rows:
        t, m = r.get("fwdbwd_s"), r.get("peak_mib")
        p1 = by.get((r["impl"], r["seq"], 1), {})
        dense = by.get(("dense_ring", r["seq"], r["world"]), {})
        single = by.get(("single_2t", r["seq"], 1), {})
        r["mem_vs_p1"] = m / p1["peak_mib"] if m and p1.get("peak_mib") else None
        r["speedup_vs_p1"] = p1["fwdbwd_s"] / t if t and p1.get("fwdbwd_s") else None
        is_ring = r["impl"] == "ring_dilated"
        r["x_faster_than_dense_ring"] = dense["fwdbwd_s"] / t if is_ring and t and dense.get("fwdbwd_s") else None
        r["mem_vs_dense_ring"] = m / dense["peak_mib"] if is_ring and m and dense.get("peak_mib") else None
        r["x_faster_than_single_2t"] = single["fwdbwd_s"] / t if is_ring and t and single.get("fwdbwd_s") else None


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The headline ratios of issue 4 as report items (no numeric targets were set: all 'info')."""
    out = []
    for r in rows:
        if r["impl"] != "ring_dilated":
            continue
        at = f"{fmt_seq(r['seq'])} p={r['world']}"
        if r["world"] > 1 and r.get("mem_vs_p1") is not None:
            detail = f"{r['peak_mib']:.0f} MiB vs {r['peak_mib'] / r['mem_vs_p1']:.0f} MiB"
            out.append(
                {
                    "target": f"ring dilated memory per rank ÷ p=1, {at}",
                    "value": r["mem_vs_p1"],
                    "met": None,
                    "detail": detail,
                }
            )
        if r.get("x_faster_than_dense_ring") is not None:
            detail = f"{r['fwdbwd_s']:.2f} s vs {r['fwdbwd_s'] * r['x_faster_than_dense_ring']:.2f} s"
            out.append(
                {
                    "target": f"ring dilated × faster than dense ring, {at}",
                    "value": r["x_faster_than_dense_ring"],
                    "met": None,
                    "detail": detail,
                }
            )
    return out


COLUMNS = [
    Column("label", "impl"),
    Column("seq", "seq", fmt_seq),
    Column("procs", "procs × threads"),
    Column("branches", "w / r"),
    Column("fwdbwd_s", "fwd+bwd s", "{:.2f}"),
    Column("tokens_per_s", "tokens/s", "{:.0f}"),
    Column("gflops", "useful GFLOP/s", "{:.1f}"),
    Column("peak_mib", "peak MiB/rank", "{:.1f}"),
    Column("mem_vs_p1", "mem ÷ p=1", "{:.2f}"),
    Column("speedup_vs_p1", "speed-up vs p=1", "{:.2f}"),
    Column("x_faster_than_dense_ring", "× faster than dense ring", "{:.1f}"),
    Column("mem_vs_dense_ring", "mem ÷ dense ring", "{:.2f}"),
    Column("x_faster_than_single_2t", "× faster than 1 proc × 2 thr", "{:.2f}"),
    Column("other_cpu_pct", "other load %", "{:.0f}"),
    Column("notes", "notes"),
]


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Run every row; write ``ring_dilated.json`` and the PNGs; return the report."""
    seqs = args.seqs or (QUICK_SEQS if args.quick else FULL_SEQS)
    worlds, impls = args.worlds or WORLDS, args.impls or IMPLS
    out = Path(args.out)
    t0 = time.perf_counter()
    report = base_report(
        "ring_dilated",
        args,
        {
            "batch": BATCH,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "causal": True,
            "branches": "segment_lengths=[min(2048, S/16), min(8192, S/4), S], dilation_rates=[1, 4, 16]",
            "seqs": seqs,
            "worlds": worlds,
            "impls": impls,
            "calls": args.calls,
            "max_call_s": args.max_call_s,
            "malloc_mmap_threshold": args.malloc_mmap_threshold,
            "time_statistic": "slowest rank's median of the timed calls (after one small dense warm-up call)",
            "memory_statistic": "largest rank's peak RSS above its RSS before its input shards existed",
        },
        [],
    )
    cores = report["machine"]["usable_cpus"]
    mm = report["matmul"]["1_thread"].get("gflops_best") or 50.0
    throughput = Throughput(cores, mm)
    seen: dict[tuple[str, int], tuple[int, float]] = {}
    rows: list[dict[str, Any]] = report["rows"]
    for seq, p, impl in planned(seqs, worlds, impls):
        row = run_planned(seq, p, impl, args, throughput, seen)
        segs, rates = row.get("segment_lengths"), row.get("dilation_rates")
        row["branches"] = f"{[fmt_seq(w) for w in segs]} / {rates}".replace("'", "") if segs else "dense"
        rows.append(row)
        print(
            f"  {LABELS[impl]:>48} {fmt_seq(seq):>5} p={p} fwd+bwd={row.get('fwdbwd_s', float('nan')):.2f}s "
            f"peak={row.get('peak_mib', float('nan')):.0f}MiB/rank {row.get('notes', '')}",
            flush=True,
        )
        write_json(out / "ring_dilated.json", report)
    derive(rows)
    label_rows(rows, LABELS, cores)
    report["targets"] = summary(rows)
    finish_report(report, t0)
    write_json(out / "ring_dilated.json", report)
    title = f"ring dilated attention (w=[2K,8K,S], r={DILATION_RATES}), causal, B{BATCH} H{HEADS} D{HEAD_DIM} fp32"
    plots(out, "ring_dilated", rows, impls, LABELS, COLORS, seqs, title)
    return report


def format_report(report: dict[str, Any]) -> str:
    """Markdown: header, results table, headline ratios."""
    head = format_header(report, "ring dilated attention (issue 4)")
    return "\n\n".join([head, markdown_table(report["rows"], COLUMNS), format_targets(report["targets"])])


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ring_dilated", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--seqs", type=int, nargs="+", help="override the total sequence lengths (multiples of 64)")
    p.add_argument("--worlds", type=int, nargs="+", help="override the rank counts (default 1 2 4)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="override the rows")
    args = p.parse_args(argv)
    resolve_common_args(args)
    report = drive(args)
    print()
    print(format_report(report))
    print(f"\nwrote {Path(args.out) / 'ring_dilated.json'}, ring_dilated_time.png, ring_dilated_memory.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
