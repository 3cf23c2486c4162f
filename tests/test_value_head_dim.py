"""Multi-head latent attention (DeepSeek V2/V3): ``v`` has a head dim of its own, on every path.

``q``/``k`` ``[.., 8]`` with ``v`` ``[.., 5]`` (smaller) or ``[.., 12]`` (larger); the output has ``v``'s head dim.

- block kernels: ``cpu_flash`` (the smaller side zero-padded) and the tiled ``torch`` kernel against an fp64
  softmax: out, LSE, dq/dk/dv, causal and not, m != n, uneven tiles, fp64 / fp32 / bf16;
- the kernel choice with a value head dim (FlashAttention-2 while the wider dim fits, else the
  memory-efficient kernel, which takes it natively), and the CUDA wrappers on meta tensors;
- ``ds_ring.dilated_attention`` (one process) against the float64 oracle: dense, dilated, GQA, windows, sinks,
  packed documents, with either kernel;
- ring and all-gather over 1-4 ranks (contiguous and zigzag, dense and dilated, windows, documents, sinks),
  Ulysses over 2 and hybrid 2 × 2 (ring and all-gather across the ring group): out, LSE and the gradients;
- still refused, naming the argument: ``k``/``v`` of other batch, seq or heads, ``q``/``k`` of other head dims.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import ds_ring
from ds_ring.kernels import chunked, fused
from ds_ring.kernels.block import GpuFacts, kernel_for
from tests.block_cases import check_against_oracle
from tests.sharded_cases import EveryStrategy, check_case, seeded, strategy_pairs

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
H100, RTX4090 = GpuFacts((9, 0)), GpuFacts((8, 9))
TOLERANCE = {F64: 1e-12, F32: 2e-5, BF16: 3e-2}
D, SMALLER, LARGER = 8, 5, 12
L = 6  # rows per rank


@pytest.mark.parametrize("tile_bytes", [chunked.TILE_BYTES, 7 * 5 * 8], ids=["one tile", "uneven tiles"])
@pytest.mark.parametrize("kernel", [fused.CPU_FLASH, chunked.CHUNKED], ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [F64, F32, BF16], ids=str)
@pytest.mark.parametrize("v_head_dim", [SMALLER, LARGER])
def test_block_kernels_with_value_head_dim(monkeypatch, kernel, dtype, v_head_dim, tile_bytes):
    monkeypatch.setattr(chunked, "TILE_BYTES", tile_bytes)
    for shape, causal in (((2, 3, 17, D, 17), True), ((1, 2, 9, D, 30), False)):
        check_against_oracle(kernel, dtype, shape, causal, "cpu", TOLERANCE[dtype], v_head_dim=v_head_dim)


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "v_head_dim", "gpu", "name"),
    [
        ("cpu", F32, 192, 128, None, "cpu_flash"),  # v zero-padded to 192
        ("cpu", BF16, 64, 128, None, "cpu_flash"),  # q/k zero-padded to 128
        ("cuda", BF16, 192, 128, H100, "cuda_flash"),  # DeepSeek V3's dims; v padded to 192, as HF does
        ("cuda", F16, 128, 256, H100, "cuda_flash"),
        ("cuda", BF16, 128, 320, H100, "cuda_efficient"),  # the wider dim is past FlashAttention-2's 256
        ("cuda", F16, 192, 200, RTX4090, "cuda_efficient"),  # 200 -> 200 > 192 on sm89
        ("cuda", F32, 192, 128, H100, "cuda_efficient"),  # takes v's head dim natively
        ("cuda", F64, 192, 128, H100, "torch"),
    ],
)
def test_kernel_choice_with_value_head_dim(device, dtype, head_dim, v_head_dim, gpu, name):
    assert kernel_for(device, dtype, head_dim, gpu, v_head_dim=v_head_dim).name == name


@pytest.mark.parametrize("kernel", [fused.CUDA_FLASH, fused.CUDA_EFFICIENT], ids=lambda k: k.name)
@pytest.mark.parametrize("v_head_dim", [12, 36])
def test_cuda_wrappers_take_a_value_head_dim_on_meta_tensors(kernel, v_head_dim):
    batch, heads, m, d, n = 2, 3, 40, 20, 40
    q, k = (torch.empty(batch, heads, rows, d, dtype=F16, device="meta") for rows in (m, n))
    v = torch.empty(batch, heads, n, v_head_dim, dtype=F16, device="meta")
    out, lse = kernel.forward(q, k, v, True, 0.125)
    assert (out.shape, lse.shape) == ((batch, heads, m, v_head_dim), (batch, heads, m))
    grads = kernel.backward(torch.empty_like(out), q, k, v, out, lse, True, 0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def _one_process(q, k, v, segments, rates, *, layout, **options):
    return ds_ring.dilated_attention(q, k, v, segments, rates, **options)


@pytest.mark.parametrize("kernel", [None, "torch"], ids=["default kernel", "torch kernel"])
@pytest.mark.parametrize("v_head_dim", [SMALLER, LARGER])
def test_one_process(monkeypatch, kernel, v_head_dim):
    if kernel is None:
        monkeypatch.delenv("DS_RING_KERNEL", raising=False)
    else:
        monkeypatch.setenv("DS_RING_KERNEL", kernel)
    variants = [
        dict(),
        dict(segments=[8, 16, 33], rates=[1, 2, 4], head_offset=1),
        dict(window=5, sinks=True),
        dict(window=1),
        dict(cu_seqlens=[0, 11, 12, 33], segments=[4, 16], rates=[1, 2]),
    ]
    grid = itertools.product(variants, [(4, 4), (4, 2), (4, 1)], [False, True], ["float64", "float32"])
    for i, (variant, (h, hkv), causal, dtype) in enumerate(grid):
        case = dict(causal=causal or "window" in variant, heads=h, kv_heads=hkv, dtype=dtype, batch=2, seq=33,
                    head_dim=D, v_head_dim=v_head_dim, seed=i, **variant)  # fmt: skip
        check_case(case, _one_process)


def _ring_cases(world: int) -> list[dict]:
    seq = world * L
    cases = []
    grid = itertools.product(["ring", "allgather"], [False, True], ["contiguous", "zigzag"], [SMALLER, LARGER])
    for i, (comm, causal, layout, dv) in enumerate(grid):
        cases.append(dict(communication=comm, causal=causal, layout=layout, v_head_dim=dv, heads=4,
                          kv_heads=(4, 2, 1)[i % 3], dtype="float32" if i % 5 == 4 else "float64"))  # fmt: skip
    for comm, dv in itertools.product(["ring", "allgather"], [SMALLER, LARGER]):
        base = dict(communication=comm, layout="contiguous", v_head_dim=dv, heads=4, kv_heads=2)
        cases += [
            dict(base, causal=False, segments=[L // 2, 2 * L, seq], rates=[1, 2, 4], head_offset=1),
            dict(base, causal=True, segments=[L + 1, seq], rates=[3, 2]),
            dict(base, causal=True, window=L + 2, sinks=True),
            dict(base, causal=True, cu_seqlens=[0, 5, seq - 3, seq] if world > 1 else [0, 2, seq]),
        ]
    return seeded(cases, batch=2, seq=seq, head_dim=D)


def _strategy_cases(world: int, ring: int) -> list[dict]:
    seq = world * L
    cases = []
    for i, ((strategy, comm), dv) in enumerate(itertools.product(strategy_pairs(ring), [SMALLER, LARGER])):
        base = dict(strategy=strategy, communication=comm, v_head_dim=dv, heads=4, kv_heads=(4, 2, 1)[i % 3])
        cases += [
            dict(base, causal=False, layout="contiguous"),
            dict(base, causal=True, layout="zigzag"),
            dict(base, causal=i % 2 == 0, layout="contiguous", segments=[L, seq], rates=[1, 2], head_offset=1),
            dict(base, causal=True, layout="contiguous", window=L + 1, sinks=True),
            dict(base, causal=True, layout="contiguous", cu_seqlens=[0, 7, seq]),
        ]
    return seeded(cases, batch=1, seq=seq, head_dim=D)


class TestEveryStrategy(EveryStrategy):
    """A value head dim of its own on ring and all-gather over 1-4 ranks, Ulysses over 2 and hybrid 2 × 2."""

    ring_cases = staticmethod(_ring_cases)
    strategy_cases = staticmethod(_strategy_cases)


@pytest.mark.parametrize(
    ("k_shape", "v_shape", "message"),
    [
        ((1, 16, 2, 8), (1, 12, 2, 6), r"k \(1, 16, 2, 8\) and v \(1, 12, 2, 6\) must agree in batch, seq and"),
        ((1, 16, 2, 8), (1, 16, 1, 6), r"must agree in batch, seq and kv_heads .* only the last dim"),
        ((1, 16, 2, 8), (2, 16, 2, 8), r"k .* and v .* must agree in batch, seq and kv_heads"),
        ((1, 16, 2, 6), (1, 16, 2, 6), r"q \(1, 16, 4, 8\) and k \(1, 16, 2, 6\) must agree in batch, seq and head"),
    ],
)
def test_mismatched_shapes_are_refused(k_shape, v_shape, message):
    q = torch.randn(1, 16, 4, 8)
    k, v = torch.randn(k_shape), torch.randn(v_shape)
    for attention in (ds_ring.dilated_attention, ds_ring.ring_dilated_attention):  # no process group: one rank
        with pytest.raises(ValueError, match=message):
            attention(q, k, v)
