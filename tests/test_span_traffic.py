"""What a ring computes and moves for bidirectional spans, counted by hooks (not read from the code).

- compute: the score entries the block kernels are given (a full block ``m·n``, a causal one ``m(m+1)/2``) sum over
  the ranks to exactly the visible pairs of the mask: ``S(S+1)/2`` causal, plus ``s(s-1)/2`` per span of ``s``
  tokens; nothing in a future block that no span reaches is computed;
- traffic: spans inside a shard move exactly the bytes of causal attention; a span crossing into the next shard by
  ``t`` rows moves those ``t`` K/V rows once to the previous rank (forward, and again in the backward) and their
  dK/dV once back, on top of causal attention's; a prefix-LM prefix the same.

``python -m tests.test_span_traffic`` prints the table of docs/design.md §Bidirectional spans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import ds_ring
import ds_ring.kernels.dilated as dilated
from ds_ring.hooks import register_hook
from tests.dist import CaseLog, assert_no_failures, run_distributed

B, H, D = 1, 4, 8


@contextlib.contextmanager
def _counting(counts: dict[str, int]) -> Iterator[None]:
    """Count the forward block-kernel calls and the score entries they are given (causal blocks: the triangle)."""
    kernel = dilated.block_forward

    def counted(q, k, v, *, causal, **options):
        m, n = q.shape[-2], k.shape[-2]
        counts["blocks"] += 1
        counts["entries"] += q.shape[0] * q.shape[1] * (m * (m + 1) // 2 if causal else m * n)
        return kernel(q, k, v, causal=causal, **options)

    dilated.block_forward = counted
    try:
        yield
    finally:
        dilated.block_forward = kernel


def measure(rows: int, **options) -> dict[str, int]:
    """This rank's forward blocks and score entries and its bytes sent (``kv``: K/V forward and backward,
    ``dkv``: gradient blocks) for one forward + backward of dense attention on ``rows`` rows per rank."""
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(B, rows, H, D, generator=g, requires_grad=True) for _ in range(3))
    counts = {"blocks": 0, "entries": 0}
    events = []
    with register_hook(events.append), _counting(counts):
        out = ds_ring.ring_dilated_attention(q, k, v, **options)
    with register_hook(events.append):
        out.sum().backward()
    for name, op in (("kv", "ring_kv"), ("dkv", "ring_dkv")):
        steps = [e for e in events if e.kind == "ring_step" and e.phase == "end" and e.op == op and e.rank == rank]
        counts[f"{name}_bytes"] = sum(e.nbytes for e in steps)
    return counts


def _summed(world: int, counts: dict[str, int]) -> list[dict[str, int]]:
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, counts)
    return everyone


def _pairs(seq: int, spans: list[tuple[int, int]]) -> int:
    """Visible (query, key) pairs of ``causal OR same span`` per batch row and head."""
    return seq * (seq + 1) // 2 + sum((b - a) * (b - a - 1) // 2 for a, b in spans)


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    L = 12
    seq = world * L
    row_bytes = 2 * B * H * D * 4  # one K and V row, fp32
    causal = _summed(world, measure(L, causal=True))
    inside = [(2, 6), (L + 1, L + 9)] if world > 1 else [(2, 6)]
    crossing = [(2, 6), (2 * L - 3, 2 * L + 5)]  # rank 2's first 5 rows reach back into rank 1
    for layout in ("contiguous", "zigzag"):
        with log.case(f"{layout}: entries computed = visible pairs of the mask"):
            for spans in ([], inside, crossing if world > 2 else inside):
                got = _summed(world, measure(L, causal=True, layout=layout, bidirectional_spans=spans or None))
                assert sum(c["entries"] for c in got) == B * H * _pairs(seq, spans), (spans, got)
    with log.case("spans inside shards: causal attention's bytes"):
        got = _summed(world, measure(L, causal=True, bidirectional_spans=inside))
        assert [(c["kv_bytes"], c["dkv_bytes"]) for c in got] == [(c["kv_bytes"], c["dkv_bytes"]) for c in causal]
    if world > 2:
        with log.case("a span 5 rows into the next shard: 5 K/V rows back one hop (twice), their dK/dV once"):
            got = _summed(world, measure(L, causal=True, bidirectional_spans=crossing))
            for r, (c, s) in enumerate(zip(causal, got, strict=True)):
                extra_kv = 2 * 5 * row_bytes if r == 2 else 0
                extra_dkv = 5 * row_bytes if r == 1 else 0
                assert s["kv_bytes"] == c["kv_bytes"] + extra_kv, (r, c, s)
                assert s["dkv_bytes"] == c["dkv_bytes"] + extra_dkv, (r, c, s)
    if world > 1:
        with log.case("prefix of 1.5 shards: rank 1's first L/2 rows back to rank 0"):
            got = _summed(world, measure(L, causal=True, prefix_lengths=L + L // 2))
            assert sum(c["entries"] for c in got) == B * H * _pairs(seq, [(0, L + L // 2)]), got
            for r, (c, s) in enumerate(zip(causal, got, strict=True)):
                assert s["kv_bytes"] == c["kv_bytes"] + (2 * (L // 2) * row_bytes if r == 1 else 0), (r, c, s)
                assert s["dkv_bytes"] == c["dkv_bytes"] + ((L // 2) * row_bytes if r == 0 else 0), (r, c, s)
    return log.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_span_traffic(world: int) -> None:
    assert_no_failures(run_distributed(_rank, world, timeout=90))


def _table_rank(rank: int, world: int, rows: int) -> list[dict[str, int]] | None:
    seq = world * rows
    images = [(rows // 2, rows // 2 + rows // 4), (2 * rows - rows // 8, 2 * rows + rows // 8)]  # one crosses 1|2
    cases = {
        "non-causal": dict(causal=False),
        "causal": dict(causal=True),
        "image spans (2 of S/16, one crossing a boundary)": dict(causal=True, bidirectional_spans=images),
        "prefix-LM, prefix 1.5 shards": dict(causal=True, prefix_lengths=rows + rows // 2),
    }
    table = []
    for name, options in cases.items():
        got = _summed(world, measure(rows, **options))
        table.append({"case": name, "seq": seq, **{key: [c[key] for c in got] for key in got[0]}})
    return table if rank == 0 else None


if __name__ == "__main__":
    world, rows = 4, 256
    (table, *_) = run_distributed(_table_rank, world, timeout=600, rows=rows)
    print(f"world {world}, {rows} rows per rank, {H} heads of {D}, fp32, batch {B}")
    print("| mask | kernel calls (fwd, all ranks) | score entries (fwd) | K/V bytes sent (fwd + bwd, all ranks) | "
          "dK/dV bytes sent |")  # fmt: skip
    print("|---|---|---|---|---|")
    for row in table:
        print(f"| {row['case']} | {sum(row['blocks'])} | {sum(row['entries']):,} | {sum(row['kv_bytes']):,} | "
              f"{sum(row['dkv_bytes']):,} |")  # fmt: skip
