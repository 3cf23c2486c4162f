"""Dense causal ring attention on CPU ranks: ring vs all-gather vs ``ring-attention-pytorch`` (issue 3).

    python -m benchmarks.ring [--quick] [--out DIR]

Per-rank peak memory and forward+backward time of dense causal attention (batch 1, 8 heads,
head_dim 64, fp32) over a sequence of 16K..128K tokens in total (``--quick``: 8K, 16K) sharded
over p = 1, 2, 4 ranks, one process and one torch thread per rank, gloo over loopback
(:mod:`benchmarks.ranks`). On a 2-core machine p = 4 oversubscribes the cores (4 processes on 2
cores): its times include time-slicing, its memory per rank does not.

Implementations (every rank gets its local shard ``[1, S/p, 8, 64]`` and returns its output shard):

``ring`` / ``ring_zigzag``
    ``ds_ring.ring_dilated_attention(..., communication="ring")`` with ``layout="contiguous"`` /
    ``"zigzag"`` (rank r holds chunks r and 2p-1-r of 2p: balanced causal work).
``allgather``
    ``ds_ring.ring_dilated_attention(..., communication="allgather")``, contiguous.
``rap``
    PyPI ``ring-attention-pytorch==0.5.20``, ``ring_flash_attn(q, k, v, mask=None, causal,
    bucket_size=1024, ring_reduce_col=p > 1, striped_ring_attn=False, max_lookback_seq_len=None,
    ring_size=p)``: its pure-PyTorch ring path (the one ``RingAttention(use_cuda_kernel=False)``
    calls), on the same ``[B, S/p, H, D]`` contiguous shards. It computes every
    ``bucket × bucket`` block, masked ones included, and synchronises (``barrier``) after each hop.
``torch_cp``
    PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel`` around
    ``F.scaled_dot_product_attention``), which takes whole-sequence buffers and shards them itself,
    so the shards are gathered first. On CPU it fails (no sharding strategy for the CPU flash
    kernel); the row records the error.

At p = 1 the three ds_ring variants are the same single-rank computation: one ``ring`` row stands
for all of them. Every launch first makes one small dense warm-up call whose output is compared
with ``ds_ring.ring_dilated_attention`` on the same shards (``warm-up err``: checks that each
library is called correctly). Rows whose one call, estimated from measured GFLOP/s, would take
longer than ``--max-call-s``, or whose estimated memory exceeds the available memory, are skipped
with the estimate recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.dilated import pairs_dense, pairs_ds_ring
from benchmarks.harness import Column, Series, Skip, fmt_seq, markdown_table, plot_panels, wait_for_idle, write_json
from benchmarks.libraries import ensure_libraries
from benchmarks.ranks import (
    ATTENTION_RANK,
    AttentionFn,
    Throughput,
    base_report,
    finish_report,
    format_header,
    format_targets,
    launch,
    mem_available_mib,
    summarize,
)

if TYPE_CHECKING:
    from torch import Tensor

MODULE = "benchmarks.ring"
BATCH, HEADS, HEAD_DIM = 1, 8, 64
FULL_SEQS = [16384, 32768, 65536, 131072]
QUICK_SEQS = [8192, 16384]
WORLDS = [1, 2, 4]
IMPLS = ["ring", "ring_zigzag", "allgather", "rap", "torch_cp"]
DS_RING = {"ring": ("ring", "contiguous"), "ring_zigzag": ("ring", "zigzag"), "allgather": ("allgather", "contiguous")}
"""ds_ring variants: (communication, layout)."""
LABELS = {
    "ring": "ds_ring ring (contiguous)",
    "ring_zigzag": "ds_ring ring (zigzag)",
    "allgather": "ds_ring all-gather",
    "rap": "ring-attention-pytorch 0.5.20",
    "torch_cp": "torch context_parallel",
}
COLORS = {"ring": "tab:blue", "ring_zigzag": "tab:cyan", "allgather": "tab:orange", "rap": "tab:red", "torch_cp": "k"}
RAP_PACKAGE = "ring-attention-pytorch"
RAP_BUCKET = 1024
"""``bucket_size`` passed to ring-attention-pytorch (``ring_flash_attn``'s default)."""
FALLBACK_EFFICIENCY = {"rap": 0.05}
"""Useful attention GFLOP/s per core as a fraction of 1-thread matmul GFLOP/s, assumed before an
implementation is measured (:data:`DEFAULT_EFFICIENCY` for those not listed)."""
DEFAULT_EFFICIENCY = 0.35
BWD_FLOP_FACTOR = 2.5
"""Backward flop = 2.5 × forward flop (FlashAttention convention): fwd+bwd = 3.5 × fwd."""


def gflop_from_pairs(pairs: int, *, batch: int = BATCH, head_dim: int = HEAD_DIM) -> float:
    """Useful forward+backward GFLOP (1e9 flop) of ``pairs`` computed, unmasked (query, key) pairs per
    batch element: 4·head_dim flop each forward (QKᵀ and PV), times 3.5 for forward + backward."""
    return (1.0 + BWD_FLOP_FACTOR) * 4.0 * head_dim * batch * pairs / 1e9


def fwdbwd_gflop(
    seq: int, segment_lengths: list[int] | None, dilation_rates: list[int] | None, causal: bool, *, heads: int = HEADS
) -> float:
    """Useful forward+backward GFLOP of one call: dense, or LongNet with every head computing every
    branch (``benchmarks.dilated``'s exact pair counts)."""
    if segment_lengths is None:
        return gflop_from_pairs(pairs_dense(seq, heads, causal))
    return gflop_from_pairs(pairs_ds_ring(seq, heads, list(segment_lengths), list(dilation_rates or []), causal))


# --------------------------------------------------------------------------------------
# Rank side: the factory attention_rank calls (see benchmarks.ranks)
# --------------------------------------------------------------------------------------


def make_attention(cfg: dict[str, Any], rank: int, world: int) -> AttentionFn:
    """``attn(q, k, v, segment_lengths, dilation_rates) -> out`` on local shards for ``cfg["impl"]``."""
    impl, causal, timeout = cfg["impl"], cfg["causal"], cfg["comm_timeout_s"]
    if impl in DS_RING:
        import ds_ring

        communication, layout = DS_RING[impl]

        def ds_ring_attn(q: Tensor, k: Tensor, v: Tensor, segs: list[int] | None, rates: list[int] | None) -> Tensor:
            return ds_ring.ring_dilated_attention(
                q, k, v, segs, rates, causal=causal, communication=communication, layout=layout, timeout_s=timeout
            )

        return ds_ring_attn
    if impl == "rap":
        return _rap_attention(causal, world)
    if impl == "torch_cp":
        return _torch_cp_attention(causal, world)
    raise ValueError(f"unknown impl {impl!r}")


def _rap_attention(causal: bool, world: int) -> AttentionFn:
    """ring-attention-pytorch's CPU ring path on contiguous shards (``ring_reduce_col`` when p > 1)."""
    try:
        from ring_attention_pytorch import ring_flash_attn
    except ImportError as exc:
        raise Skip(f"{RAP_PACKAGE} not installed (pip install {RAP_PACKAGE}==0.5.20): {exc}") from exc

    def rap_attn(q: Tensor, k: Tensor, v: Tensor, segs: list[int] | None, rates: list[int] | None) -> Tensor:
        if segs is not None:
            raise ValueError("ring-attention-pytorch has no dilated attention")
        bucket = min(RAP_BUCKET, q.shape[1])
        return ring_flash_attn(q, k, v, None, causal, bucket, world > 1, False, None, world)

    return rap_attn


def _torch_cp_attention(causal: bool, world: int) -> AttentionFn:
    """PyTorch context parallelism around SDPA (whole-sequence buffers, sharded by CP itself)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import ds_ring

    mesh = init_device_mesh("cpu", (world,))

    def cp_attn(q: Tensor, k: Tensor, v: Tensor, segs: list[int] | None, rates: list[int] | None) -> Tensor:
        if segs is not None:
            raise ValueError("context_parallel runs SDPA: no dilated attention")
        full = [ds_ring.gather_sequence(t.detach()).transpose(1, 2).contiguous() for t in (q, k, v)]
        with context_parallel(mesh, buffers=full, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(full)):
            out = F.scaled_dot_product_attention(*(t.requires_grad_() for t in full), is_causal=causal)
        return out.transpose(1, 2)

    return cp_attn


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def planned(seqs: list[int], worlds: list[int], impls: list[str]) -> list[tuple[int, int, str]]:
    """(seq, p, impl) in run order; at p = 1 only ``ring`` (for every ds_ring variant) and ``rap``."""
    return [(seq, p, impl) for seq in seqs for p in worlds for impl in impls if p > 1 or impl in ("ring", "rap")]


def run_row(
    impl: str,
    seq: int,
    world: int,
    args: argparse.Namespace,
    throughput: Throughput,
    memory_seen: dict[tuple[str, int], tuple[int, float]],
    *,
    segment_lengths: list[int] | None = None,
    dilation_rates: list[int] | None = None,
    factory: str = f"{MODULE}:make_attention",
    layout: str | None = None,
    threads: int = 1,
    distributed: bool = True,
    extra_cfg: dict[str, Any] | None = None,
    key: str | None = None,
    causal: bool = True,
    fwd: bool = False,
    calls: int | None = None,
    warmup: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Estimate, maybe skip, else launch one configuration; return its table row.

    ``memory_seen`` maps (key, p) to the last (seq, working MiB per rank) measured, for the memory
    estimate (linear in seq at fixed p); ``key`` (default ``impl``) names the implementation in
    ``throughput``, ``memory_seen`` and the row. ``factory`` builds the attention in each rank
    (:func:`benchmarks.ranks.attention_rank`), ``layout`` is the shards' layout for the warm-up
    check (None: no check), ``fwd`` also times forward-only calls, ``calls`` overrides the number of
    timed calls, ``warmup`` the warm-up call (default: dense, ``max(1024, 256·p)`` tokens). Also
    used by ``ring_dilated``, ``strategies`` and the suite.
    """
    key = key or impl
    gflop = fwdbwd_gflop(seq, segment_lengths, dilation_rates, causal)
    busy = throughput.busy_cores(world, threads)
    efficiency = FALLBACK_EFFICIENCY.get(impl, DEFAULT_EFFICIENCY)
    est_s, how = throughput.estimate_s([(key, world), key], gflop, busy, efficiency)
    row: dict[str, Any] = {
        "impl": key,
        "seq": seq,
        "world": world,
        "threads_per_rank": threads,
        "useful_gflop": gflop,
        "causal": causal,
        "estimated_call_s": est_s,
        "segment_lengths": segment_lengths,
        "dilation_rates": dilation_rates,
    }
    reason = None
    if est_s > args.max_call_s:
        reason = f"one fwd+bwd call estimated {how} > --max-call-s {args.max_call_s:.0f}"
    seen = memory_seen.get((key, world))
    available = mem_available_mib()
    if reason is None and seen and available:
        est_mib = seen[1] * seq / seen[0]
        if est_mib * world > 0.8 * available:
            reason = (
                f"estimated {est_mib:.0f} MiB per rank × {world} ranks (from {fmt_seq(seen[0])}: {seen[1]:.0f} MiB, "
                f"∝ seq) > 80% of the {available:.0f} MiB available"
            )
    if reason is not None:
        row.update(notes="skipped: " + reason, skipped=reason)
        return row
    if args.wait_idle_s > 0:
        row["cpu_busy_before"] = wait_for_idle(0.15, timeout_s=args.wait_idle_s)
    calls = calls or (1 if est_s > args.single_call_above_s else args.calls)
    warmup = warmup or {"seq": max(1024, 256 * world), "segment_lengths": None, "dilation_rates": None}
    cfg = {
        "factory": factory,
        "impl": impl,
        "seq": seq,
        "batch": BATCH,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "causal": causal,
        "segment_lengths": segment_lengths,
        "dilation_rates": dilation_rates,
        "calls": calls,
        "fwd": fwd,
        "warmup": warmup,
        "check_layout": layout,
        "overlap": impl in ("ring", "ring_zigzag") and world > 1,
        "comm_timeout_s": args.timeout_s,
        **(extra_cfg or {}),
    }
    timeout = max(300.0, 4.0 * est_s * (calls + 1) + 120.0)
    got = launch(ATTENTION_RANK, cfg, world=world, threads=threads, timeout_s=timeout, distributed=distributed)
    row.update(summarize(got))
    if row.get("fwdbwd_s"):
        row["tokens_per_s"] = seq / row["fwdbwd_s"]
        row["gflops"] = gflop / row["fwdbwd_s"]
        basis = f"{fmt_seq(seq)} p={world}"
        throughput.record(key, gflop, row["fwdbwd_s"], busy, got.other_cpu_share, basis)
        throughput.record((key, world), gflop, row["fwdbwd_s"], busy, got.other_cpu_share, basis)
        memory_seen[(key, world)] = (seq, row["peak_mib"])
    return row


def derive(rows: list[dict[str, Any]]) -> None:
    """Ratios against ring at p = 1 (same seq) and against ring-attention-pytorch (same seq, p), in place."""
    by = {(r["impl"], r["seq"], r["world"]): r for r in rows}
    for r in rows:
        p1 = by.get(("ring", r["seq"], 1), {})
        rap = by.get(("rap", r["seq"], r["world"]), {})
        t, t1, trap = r.get("fwdbwd_s"), p1.get("fwdbwd_s"), rap.get("fwdbwd_s")
        m, m1 = r.get("peak_mib"), p1.get("peak_mib")
        r["mem_vs_p1"] = m / m1 if m and m1 and r["impl"] in DS_RING else None
        r["speedup_vs_p1"] = t1 / t if t and t1 and r["impl"] in DS_RING else None
        r["x_faster_than_rap"] = trap / t if t and trap and r["impl"] != "rap" else None


def targets(rows: list[dict[str, Any]], cores: int) -> list[dict[str, Any]]:
    """Issue 3's targets, evaluated (reported, not asserted)."""
    out: list[dict[str, Any]] = []
    for r in rows:
        if r["world"] == 4 and r["impl"] in DS_RING and r.get("mem_vs_p1") is not None:
            out.append(
                {
                    "target": f"{LABELS[r['impl']]} peak memory per rank at p=4 ≤ 0.30 × p=1, {fmt_seq(r['seq'])}",
                    "value": r["mem_vs_p1"],
                    "met": r["mem_vs_p1"] <= 0.30 if r["impl"] != "allgather" else None,
                    "detail": f"{r['peak_mib']:.0f} MiB vs {r['peak_mib'] / r['mem_vs_p1']:.0f} MiB"
                    + (" (all-gather: shown for comparison, no target)" if r["impl"] == "allgather" else ""),
                }
            )
        if r["world"] == 2 and r["impl"] in ("ring", "ring_zigzag") and r.get("speedup_vs_p1") is not None:
            note = "" if cores >= 2 else f" (only {cores} usable core: not meaningful)"
            out.append(
                {
                    "target": f"{LABELS[r['impl']]}: 2 ranks on 2 cores ≥ 1.8× faster than 1 rank, {fmt_seq(r['seq'])}",
                    "value": r["speedup_vs_p1"],
                    "met": r["speedup_vs_p1"] >= 1.8,
                    "detail": f"{r['fwdbwd_s']:.2f} s vs {r['fwdbwd_s'] * r['speedup_vs_p1']:.2f} s{note}; "
                    f"other load {r.get('other_cpu_pct') or 0:.0f}%",
                }
            )
        if r["impl"] in DS_RING and r.get("x_faster_than_rap") is not None:
            out.append(
                {
                    "target": f"{LABELS[r['impl']]} ≥ 5× faster than ring-attention-pytorch, "
                    f"{fmt_seq(r['seq'])} p={r['world']}",
                    "value": r["x_faster_than_rap"],
                    "met": r["x_faster_than_rap"] >= 5.0,
                    "detail": f"{r['fwdbwd_s']:.2f} s vs {r['fwdbwd_s'] * r['x_faster_than_rap']:.2f} s",
                }
            )
    return out


COLUMNS = [
    Column("label", "impl"),
    Column("seq", "seq", fmt_seq),
    Column("procs", "procs × threads"),
    Column("fwdbwd_s", "fwd+bwd s", "{:.2f}"),
    Column("tokens_per_s", "tokens/s", "{:.0f}"),
    Column("gflops", "useful GFLOP/s", "{:.1f}"),
    Column("peak_mib", "peak MiB/rank", "{:.1f}"),
    Column("inputs_mib", "inputs MiB/rank", "{:.1f}"),
    Column("mem_vs_p1", "mem ÷ p=1", "{:.2f}"),
    Column("speedup_vs_p1", "speed-up vs p=1", "{:.2f}"),
    Column("x_faster_than_rap", "× faster than rap", "{:.1f}"),
    Column("overlap_ratio", "wall ÷ compute", "{:.2f}"),
    Column("warmup_max_abs_err", "warm-up err", "{:.1e}"),
    Column("other_cpu_pct", "other load %", "{:.0f}"),
    Column("notes", "notes"),
]


def label_rows(rows: list[dict[str, Any]], labels: dict[str, str], cores: int) -> None:
    """Add ``label`` and ``procs`` (flagging oversubscription) to every row, in place."""
    for r in rows:
        r["label"] = labels.get(r["impl"], r["impl"])
        procs = r["world"] * r["threads_per_rank"]
        r["procs"] = f"{r['world']}×{r['threads_per_rank']}" + (f" (>{cores} cores)" if procs > cores else "")


def plots(
    out: Path,
    stem: str,
    rows: list[dict[str, Any]],
    impls: list[str],
    labels: dict[str, str],
    colors: dict[str, str],
    seqs: list[int],
    title: str,
) -> list[Path]:
    """``<stem>_time.png`` and ``<stem>_memory.png``: one panel per rank count, one line per impl."""
    worlds = sorted({r["world"] for r in rows})
    paths = []
    for name, key, ylabel in (
        (f"{stem}_time.png", "fwdbwd_s", "fwd+bwd time per call, slowest rank (s)"),
        (f"{stem}_memory.png", "peak_mib", "peak working memory, largest rank (MiB)"),
    ):
        panels = []
        for p in worlds:
            series = []
            for impl in impls:
                got = {r["seq"]: r.get(key) for r in rows if r["impl"] == impl and r["world"] == p}
                if any(v is not None for v in got.values()):
                    ys = [got.get(s) for s in seqs]
                    series.append(Series(labels[impl], list(seqs), ys, "-o", {"color": colors[impl]}))
            if series:
                panels.append((f"p = {p} rank{'s' if p > 1 else ''} × 1 thread", series))
        if panels:
            paths.append(
                plot_panels(out / name, panels, xlabel="total sequence length", ylabel=ylabel, title=title, xticks=seqs)
            )
    return paths


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Run every row (fresh rank processes each); write ``ring.json`` and the PNGs; return the report."""
    seqs = args.seqs or (QUICK_SEQS if args.quick else FULL_SEQS)
    worlds, impls = args.worlds or WORLDS, args.impls or IMPLS
    out = Path(args.out)
    t0 = time.perf_counter()
    report = base_report(
        "ring",
        args,
        {
            "batch": BATCH,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "attention": "dense causal",
            "threads_per_rank": 1,
            "seqs": seqs,
            "worlds": worlds,
            "impls": impls,
            "p1_rows": "ring (the same single-rank computation for every ds_ring variant) and rap",
            "rap_bucket_size": RAP_BUCKET,
            "calls": args.calls,
            "max_call_s": args.max_call_s,
            "malloc_mmap_threshold": args.malloc_mmap_threshold,
            "time_statistic": "slowest rank's median of the timed calls (after one small dense warm-up call)",
            "memory_statistic": "largest rank's peak RSS above its RSS before its input shards existed",
        },
        [RAP_PACKAGE, "deepspeed"],
    )
    cores = report["machine"]["usable_cpus"]
    mm = report["matmul"]["1_thread"].get("gflops_best") or 50.0
    throughput = Throughput(cores, mm)
    memory_seen: dict[tuple[str, int], tuple[int, float]] = {}
    rows: list[dict[str, Any]] = report["rows"]
    for seq, p, impl in planned(seqs, worlds, impls):
        layout = DS_RING[impl][1] if impl in DS_RING else ("contiguous" if impl == "rap" else None)
        row = run_row(impl, seq, p, args, throughput, memory_seen, layout=layout)
        rows.append(row)
        print(
            f"  {LABELS[impl]:>30} {fmt_seq(seq):>5} p={p} fwd+bwd={row.get('fwdbwd_s', float('nan')):.2f}s "
            f"peak={row.get('peak_mib', float('nan')):.0f}MiB/rank {row.get('notes', '')}",
            flush=True,
        )
        write_json(out / "ring.json", report)
    derive(rows)
    label_rows(rows, LABELS, cores)
    report["targets"] = targets(rows, cores)
    finish_report(report, t0)
    write_json(out / "ring.json", report)
    title = f"dense causal ring attention, B{BATCH} H{HEADS} D{HEAD_DIM} fp32, 1 thread per rank"
    plots(out, "ring", rows, impls, LABELS, COLORS, seqs, title)
    return report


def format_report(report: dict[str, Any]) -> str:
    """Markdown: header, results table, targets."""
    head = format_header(report, "dense causal ring attention (issue 3)")
    return "\n\n".join([head, markdown_table(report["rows"], COLUMNS), format_targets(report["targets"])])


def add_common_args(p: argparse.ArgumentParser, *, calls: int = 2, max_call_s: float = 600.0) -> None:
    """Options shared by the multi-rank benchmarks (``ring``, ``ring_dilated``, ``strategies``, the suite)."""
    p.add_argument("--quick", action="store_true", help="small sizes, one timed call (a few minutes on 2 cores)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="output directory")
    p.add_argument("--calls", type=int, help=f"timed fwd+bwd calls per configuration (default {calls}, quick 1)")
    p.add_argument(
        "--max-call-s",
        type=float,
        help=f"skip a row whose one fwd+bwd call is estimated (from measured GFLOP/s) above this many s "
        f"(default {max_call_s:.0f}, quick 120)",
    )
    p.add_argument(
        "--single-call-above-s",
        type=float,
        default=120.0,
        help="one timed call only when a call is estimated above this",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on every communication wait, s")
    p.add_argument(
        "--wait-idle-s",
        type=float,
        default=0.0,
        help="before each configuration wait up to this many s for the CPUs to be at most 15%% busy (default 0: don't)",
    )
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        help="run the ranks with MALLOC_MMAP_THRESHOLD_=N bytes (glibc): large tensors are then always mmap'ed and "
        "returned to the OS when freed, so RSS follows live tensors; default: glibc's dynamic threshold",
    )
    p.add_argument("--no-install", action="store_true", help="do not pip-install the libraries compared against")


def resolve_common_args(args: argparse.Namespace, *, calls: int = 2, max_call_s: float = 600.0) -> None:
    """Fill the quick / full defaults of :func:`add_common_args`'s options, in place."""
    if not args.no_install:
        ensure_libraries()
    args.calls = args.calls or (1 if args.quick else calls)
    args.max_call_s = args.max_call_s or (120.0 if args.quick else max_call_s)
    if args.malloc_mmap_threshold is not None:  # read by glibc when the fork server starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ring", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--seqs", type=int, nargs="+", help="override the total sequence lengths")
    p.add_argument("--worlds", type=int, nargs="+", help="override the rank counts (default 1 2 4)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="override the implementations")
    args = p.parse_args(argv)
    resolve_common_args(args)
    report = drive(args)
    print()
    print(format_report(report))
    print(f"\nwrote {Path(args.out) / 'ring.json'}, ring_time.png, ring_memory.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
