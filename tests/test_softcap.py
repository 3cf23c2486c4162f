"""Attention logit soft-capping (Gemma 2, VaultGemma): scores ``s`` become ``softcap·tanh(s / softcap)``.

- the tiled pure-torch kernel with ``softcap`` against an fp64 capped softmax: out, LSE, dq/dk/dv, causal and
  not, m != n, uneven tiles, a value head dim of its own, fp64 / fp32 / bf16; its score-sized tensors stay
  within the tile budget (three score tiles in the backward);
- the kernel choice: ``softcap`` always runs the tiled kernel (CPU and CUDA); forcing a fused kernel with
  ``DS_RING_KERNEL`` is a ``ValueError`` naming it;
- ``ds_ring.dilated_attention`` (one process) against the float64 oracle: dense, dilated, GQA, windows
  (one key: the elementwise piece), sinks (not capped), packed documents; the module's ``softcap``;
- ring and all-gather over 1-4 ranks (contiguous and zigzag, dense and dilated, windows, documents, sinks,
  with a value head dim of its own), Ulysses over 2 and hybrid 2 × 2;
- a softcap that is not a finite number > 0 is refused before any communication.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import ds_ring
from ds_ring.kernels import block, chunked
from ds_ring.kernels.block import GpuFacts, kernel_for
from tests.block_cases import SHAPES, LargestOutput, check_against_oracle
from tests.sharded_cases import EveryStrategy, check_case, seeded, strategy_pairs

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
H100 = GpuFacts((9, 0))
TOLERANCE = {F64: 1e-12, F32: 2e-5, BF16: 3e-2}
CAP = 0.8  # scores of randn inputs reach a few units: well into tanh's curve
L = 6  # rows per rank


@pytest.mark.parametrize("tile_bytes", [chunked.TILE_BYTES, 7 * 5 * 8], ids=["one tile", "uneven tiles"])
@pytest.mark.parametrize("dtype", [F64, F32, BF16], ids=str)
def test_tiled_kernel_with_softcap_matches_oracle(monkeypatch, dtype, tile_bytes):
    monkeypatch.setattr(chunked, "TILE_BYTES", tile_bytes)
    for shape, causal in SHAPES:
        check_against_oracle(chunked.CHUNKED, dtype, shape, causal, "cpu", TOLERANCE[dtype], softcap=CAP)
    check_against_oracle(chunked.CHUNKED, dtype, (1, 2, 9, 8, 30), False, "cpu", TOLERANCE[dtype], v_head_dim=5,
                         softcap=CAP)  # fmt: skip


def test_softcap_changes_the_result():
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=F64) * 3 for _ in range(3))
    capped, _ = chunked.CHUNKED.forward(q, k, v, False, 0.5, CAP)
    plain, _ = chunked.CHUNKED.forward(q, k, v, False, 0.5)
    assert (capped - plain).abs().max() > 0.1


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_kernel_with_softcap_never_holds_more_than_a_tile_of_scores(monkeypatch, causal):
    """64 × 64 scores per (batch, head) would be 16 KiB each; tensors of the block are 1 KiB; budget 2 KiB."""
    monkeypatch.setattr(chunked, "TILE_BYTES", 2048)
    q, k, v, dout = (torch.randn(1, 2, 64, 2) for _ in range(4))
    with LargestOutput() as seen:
        out, lse = chunked.CHUNKED.forward(q, k, v, causal, 0.5, CAP)
        chunked.CHUNKED.backward(dout, q, k, v, out, lse, causal, 0.5, CAP)
    assert seen.nbytes <= 2048, seen.nbytes


@pytest.mark.parametrize(
    ("device", "dtype", "gpu"), [("cpu", F32, None), ("cpu", F64, None), ("cuda", BF16, H100), ("cuda", F32, H100)]
)
def test_softcap_runs_the_tiled_kernel(device, dtype, gpu):
    assert kernel_for(device, dtype, 64, gpu, softcap=True) is chunked.CHUNKED
    assert kernel_for(device, dtype, 64, gpu, "torch", softcap=True) is chunked.CHUNKED


@pytest.mark.parametrize("forced", ["cpu_flash", "cuda_flash", "cuda_efficient"])
def test_a_forced_fused_kernel_refuses_softcap(monkeypatch, forced):
    with pytest.raises(ValueError, match=rf"DS_RING_KERNEL='{forced}' cannot cap attention scores .* \['torch'\]"):
        kernel_for("cuda", BF16, 64, H100, forced, softcap=True)
    monkeypatch.setenv("DS_RING_KERNEL", forced)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=rf"DS_RING_KERNEL='{forced}' cannot cap attention scores"):
        ds_ring.dilated_attention(q, q, q, softcap=CAP)
    assert block.select_kernel(torch.device("cpu"), F32, 4).name == forced  # uncapped calls keep the override


def _one_process(q, k, v, segments, rates, *, layout, **options):
    return ds_ring.dilated_attention(q, k, v, segments, rates, **options)


@pytest.mark.parametrize("softcap", [CAP, 30.0], ids=["capping", "barely capping"])
def test_one_process(softcap):
    variants = [
        dict(),
        dict(segments=[8, 16, 33], rates=[1, 2, 4], head_offset=1),
        dict(window=5, sinks=True),
        dict(window=1),  # one key per query: the elementwise piece
        dict(cu_seqlens=[0, 11, 12, 33], segments=[4, 16], rates=[1, 2]),
        dict(v_head_dim=5, window=7),
    ]
    grid = itertools.product(variants, [(4, 4), (4, 2), (4, 1)], [False, True], ["float64", "float32"])
    for i, (variant, (h, hkv), causal, dtype) in enumerate(grid):
        case = dict(causal=causal or "window" in variant, heads=h, kv_heads=hkv, dtype=dtype, batch=2, seq=33,
                    head_dim=8, softcap=softcap, seed=i, **variant)  # fmt: skip
        check_case(case, _one_process)


def test_module_softcap_is_the_functional_one():
    q, k, v = (torch.randn(1, 16, 4, 8) for _ in range(3))
    module = ds_ring.RingDilatedAttention(causal=True, softcap=CAP)
    assert module.softcap == CAP
    torch.testing.assert_close(module(q, k, v), ds_ring.dilated_attention(q, k, v, causal=True, softcap=CAP))
    module.configure(softcap=None)
    torch.testing.assert_close(module(q, k, v), ds_ring.dilated_attention(q, k, v, causal=True))


def _ring_cases(world: int) -> list[dict]:
    seq = world * L
    cases = []
    for i, (comm, causal, layout) in enumerate(
        itertools.product(["ring", "allgather"], [False, True], ["contiguous", "zigzag"])
    ):
        cases.append(dict(communication=comm, causal=causal, layout=layout, heads=4, kv_heads=(4, 2, 1)[i % 3],
                          dtype="float32" if i % 5 == 4 else "float64"))  # fmt: skip
    for comm in ["ring", "allgather"]:
        base = dict(communication=comm, layout="contiguous", heads=4, kv_heads=2)
        cases += [
            dict(base, causal=False, segments=[L // 2, 2 * L, seq], rates=[1, 2, 4], head_offset=1),
            dict(base, causal=True, segments=[L + 1, seq], rates=[3, 2], v_head_dim=5),
            dict(base, causal=True, window=L + 2, sinks=True),
            dict(base, causal=True, window=1),
            dict(base, causal=True, cu_seqlens=[0, 5, seq - 3, seq] if world > 1 else [0, 2, seq], v_head_dim=12),
        ]
    return seeded(cases, batch=2, seq=seq, head_dim=8, softcap=CAP)


def _strategy_cases(world: int, ring: int) -> list[dict]:
    seq = world * L
    cases = []
    for i, (strategy, comm) in enumerate(strategy_pairs(ring)):
        base = dict(strategy=strategy, communication=comm, heads=4, kv_heads=(4, 2, 1)[i % 3])
        cases += [
            dict(base, causal=False, layout="contiguous"),
            dict(base, causal=True, layout="zigzag", v_head_dim=5),
            dict(base, causal=True, layout="contiguous", segments=[L, seq], rates=[1, 2], head_offset=1),
            dict(base, causal=True, layout="contiguous", window=L + 1, sinks=True),
            dict(base, causal=True, layout="contiguous", cu_seqlens=[0, 7, seq]),
        ]
    return seeded(cases, batch=1, seq=seq, head_dim=8, softcap=CAP)


class TestEveryStrategy(EveryStrategy):
    """Soft-capped attention on ring and all-gather over 1-4 ranks, Ulysses over 2 and hybrid 2 × 2."""

    ring_cases = staticmethod(_ring_cases)
    strategy_cases = staticmethod(_strategy_cases)


@pytest.mark.parametrize("softcap", [0, -1.0, float("nan"), float("inf"), True, "50"])
def test_bad_softcap_is_refused(softcap):
    q = torch.randn(1, 16, 4, 8)
    for attention in (ds_ring.dilated_attention, ds_ring.ring_dilated_attention):  # no process group: one rank
        with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
            attention(q, q, q, softcap=softcap)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        ds_ring.RingDilatedAttention(softcap=softcap)
