"""Ring dilated attention on a long random sequence, sharded over CPU ranks.

Spawns ``--ranks`` processes (gloo, file rendezvous, 127.0.0.1 only), gives each its shard of a
``--seq``-token sequence, runs forward+backward of ring dilated attention, and prints per rank
the time and the peak resident memory. Each rank creates only its own shard, so the memory shown
is what a rank needs. With ``--check`` every rank also builds the full sequence and rank 0 compares
the gathered output with single-process ``ds_ring.dilated_attention``.

    python launch/demo.py --seq 65536 --ranks 2 --check
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ds_ring


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, args: argparse.Namespace, init_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks, timeout=timedelta(seconds=300)
    )
    try:
        if args.check:
            g = torch.Generator().manual_seed(0)
            full = [torch.randn(1, args.seq, args.heads, args.head_dim, generator=g) for _ in range(3)]
            local = [ds_ring.shard_sequence(x).requires_grad_() for x in full]
        else:
            g = torch.Generator().manual_seed(rank)
            shape = (1, args.seq // args.ranks, args.heads, args.head_dim)
            local = [torch.randn(shape, generator=g, requires_grad=True) for _ in range(3)]
        kwargs = dict(causal=True, communication=args.communication)
        start = time.perf_counter()
        out = ds_ring.ring_dilated_attention(*local, args.segments, args.rates, **kwargs)
        forward_s = time.perf_counter() - start
        out.sum().backward()
        total_s = time.perf_counter() - start
        report = torch.tensor([forward_s, total_s, _peak_rss_mib()], dtype=torch.float64)
        reports = [torch.zeros_like(report) for _ in range(args.ranks)]
        dist.all_gather(reports, report)
        gathered = ds_ring.gather_sequence(out.detach()) if args.check else None
        if rank == 0:
            print(
                f"ring dilated attention: {args.seq} tokens over {args.ranks} ranks ({args.seq // args.ranks} each), "
                f"w={args.segments} r={args.rates}, causal, {args.communication}"
            )
            for r, (fwd, both, rss) in enumerate(reports):
                print(f"  rank {r}: forward {fwd:6.2f} s | forward+backward {both:6.2f} s | peak RSS {rss:7.1f} MiB")
            if args.check:
                reference = ds_ring.dilated_attention(*full, args.segments, args.rates, causal=True)
                print(f"  max |ring - single-process| = {(gathered - reference).abs().max().item():.2e}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=65536, help="total tokens")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--segments", type=int, nargs="+", default=[2048, 8192, 65536])
    parser.add_argument("--rates", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--communication", choices=["ring", "allgather"], default="ring")
    parser.add_argument("--check", action="store_true", help="compare with single-process attention")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args, os.path.join(tmp, "rendezvous")), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
