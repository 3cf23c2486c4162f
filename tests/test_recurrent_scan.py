"""The cross-rank math of :mod:`ds_ring.recurrent` against one process's sequential scan and convolution.

A toy recurrence ``h_t = a_t ⊙ h_{t-1} + u_t``, ``y_t = Σ_n C_t[n] h_t[·, n]`` (elementwise decays, a state of
``[channels, n]``) and a causal depthwise convolution, on 1–4 ranks, contiguous and zigzag, one document and packed
documents (starts inside chunks, at a chunk boundary, and inside a convolution's halo): every rank's outputs and the
gradients of every input equal the whole sequence's, and the bytes exchanged do not depend on the sequence length.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist import CaseLog, assert_no_failures, run_distributed

CHANNELS, STATE, WIDTH = 3, 2, 4


def _sequential(a: torch.Tensor, u: torch.Tensor, C: torch.Tensor, starts: set[int]) -> torch.Tensor:
    """``y [t, channels]`` of the whole sequence, the state zeroed at every document start."""
    h = torch.zeros(CHANNELS, STATE, dtype=a.dtype)
    out = []
    for t in range(a.shape[0]):
        h = (0 if t in starts else a[t]) * h + u[t]
        out.append((h * C[t]).sum(-1))
    return torch.stack(out)


def _whole_conv(x: torch.Tensor, weight: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """``[channels, t]``: each document convolved on its own (zeros before it)."""
    pieces = [
        F.conv1d(x[None, :, a:b], weight.unsqueeze(1), padding=WIDTH - 1, groups=CHANNELS)[0, :, : b - a]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(pieces, dim=-1)


def _scan_cases(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from ds_ring.hooks import register_hook
    from ds_ring.parallel.order import shard_sequence
    from ds_ring.recurrent import SegmentScan, causal_conv, run_chunks, shard_pieces

    log = CaseLog()
    moved: dict[tuple[str, int], int] = {}
    for layout in ("contiguous", "zigzag"):
        for seq in (48, 96):
            chunks = world * (2 if layout == "zigzag" else 1)
            size = seq // chunks
            documents = [(0, seq), (0, 5, size, 2 * size - 2, seq) if chunks > 1 else (0, 5, seq - 1, seq)]
            for bounds in documents:
                bounds = tuple(sorted(set(bounds)))
                name = f"{layout} S={seq} documents={bounds}"
                with log.case(name):
                    g = torch.Generator().manual_seed(seq)
                    a = torch.rand(seq, CHANNELS, STATE, generator=g, dtype=torch.float64) * 0.5 + 0.5
                    u = torch.randn(seq, CHANNELS, STATE, generator=g, dtype=torch.float64)
                    C = torch.randn(seq, 1, STATE, generator=g, dtype=torch.float64)
                    x = torch.randn(CHANNELS, seq, generator=g, dtype=torch.float64)
                    weight = torch.randn(CHANNELS, WIDTH, generator=g, dtype=torch.float64)
                    w_y = torch.randn(seq, CHANNELS, generator=g, dtype=torch.float64)
                    w_c = torch.randn(CHANNELS, seq, generator=g, dtype=torch.float64)
                    whole = [t.clone().requires_grad_() for t in (a, u, C, x, weight)]
                    y = _sequential(*whole[:3], set(bounds[:-1]))
                    conv = _whole_conv(whole[3], whole[4], bounds)
                    ((y * w_y).sum() + (conv * w_c).sum()).backward()

                    local = [shard_sequence(t, None, layout=layout, dim=0).detach().requires_grad_() for t in (a, u, C)]
                    xl = shard_sequence(x, None, layout=layout, dim=1).detach().requires_grad_()
                    wl = weight.clone().requires_grad_()
                    pieces = shard_pieces(rank, world, layout, seq // world, bounds)
                    la, lu, lC = local

                    def segment(start: int, stop: int, la=la, lu=lu, lC=lC) -> SegmentScan:
                        ys = _sequential(la[start:stop], lu[start:stop], lC[start:stop], {0})
                        h = torch.zeros(CHANNELS, STATE, dtype=la.dtype)
                        for t in range(start, stop):
                            h = la[t] * h + lu[t]
                        decay_in = torch.cumprod(la[start:stop], dim=0)  # what an initial state is multiplied by

                        def correct(h_in: torch.Tensor, decay_in=decay_in, start=start, stop=stop) -> torch.Tensor:
                            return (decay_in * h_in * lC[start:stop]).sum(-1)

                        return SegmentScan(ys, h, decay_in[-1], correct)

                    def count(event, seq=seq) -> None:
                        moved[event.op, seq] = moved.get((event.op, seq), 0) + event.nbytes

                    with register_hook(count):  # forward and backward exchanges
                        y_local = run_chunks(pieces, segment, None, time_dim=0)
                        conv_local = causal_conv(xl[None], wl, None, pieces, None)[0]
                        expected_y = shard_sequence(y.detach(), None, layout=layout, dim=0)
                        expected_conv = shard_sequence(conv.detach(), None, layout=layout, dim=1)
                        torch.testing.assert_close(y_local, expected_y, rtol=1e-12, atol=1e-12)
                        torch.testing.assert_close(conv_local, expected_conv, rtol=1e-12, atol=1e-12)
                        loss = (y_local * shard_sequence(w_y, None, layout=layout, dim=0)).sum()
                        loss = loss + (conv_local * shard_sequence(w_c, None, layout=layout, dim=1)).sum()
                        loss.backward()
                    dist.all_reduce(wl.grad)
                    for got, expected, dim in zip([*local, xl], whole[:4], (0, 0, 0, 1), strict=True):
                        torch.testing.assert_close(
                            got.grad,
                            shard_sequence(expected.grad, None, layout=layout, dim=dim),
                            rtol=1e-12,
                            atol=1e-12,
                        )
                    torch.testing.assert_close(wl.grad, whole[4].grad, rtol=1e-12, atol=1e-12)
    with log.case("bytes do not grow with the sequence"):
        for op in {op for op, _ in moved}:
            assert moved.get((op, 48), 0) == moved.get((op, 96), 0), moved
        if world > 1:
            assert {op for op, _ in moved} >= {"recurrent_state", "recurrent_state_grad", "recurrent_halo"}, moved
    return log.failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cross_rank_scan_and_convolution_equal_the_sequential_whole(world: int) -> None:
    assert_no_failures(run_distributed(_scan_cases, world, timeout=120))
