"""Block kernels: which one runs where (a pure table, no GPU needed), and each one against the fp64 oracle.

- the choice for an H100, A100, RTX 4090, T4, a build without FlashAttention-2, ROCm and the CPU, and
  ``DS_RING_KERNEL`` read at every call;
- the CPU flash kernel and the tiled pure-torch kernel: out, LSE and dq/dk/dv against an fp64 softmax, causal
  and not, m != n, tiles that do not divide the block, fp64 / fp32 / bf16;
- the pure-torch kernel's score-sized tensors stay within its tile budget (every op's output measured);
- the CUDA wrappers, called on meta tensors: PyTorch's fused CUDA ops accept their arguments (None where
  the schema says so, padded head dims and LSE) and the wrappers return the block's shapes.
"""

import pytest
import torch

from ds_ring.kernels import block, chunked, fused
from ds_ring.kernels.block import GpuFacts, kernel_for
from tests.block_cases import SHAPES, LargestOutput, check_against_oracle

H100, A100, RTX4090, T4 = GpuFacts((9, 0)), GpuFacts((8, 0)), GpuFacts((8, 9)), GpuFacts((7, 5))
NO_FLASH, ROCM = GpuFacts((8, 0), flash_built=False), GpuFacts((9, 4), rocm=True)
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

CHOICES = [
    ("cpu", F32, 64, None, "cpu_flash"),
    ("cpu", BF16, 64, None, "cpu_flash"),
    ("cpu", F64, 64, None, "cpu_flash"),
    ("cuda", BF16, 128, H100, "cuda_flash"),
    ("cuda", F16, 256, H100, "cuda_flash"),
    ("cuda", F16, 20, H100, "cuda_flash"),  # padded to 24
    ("cuda", BF16, 512, H100, "cuda_efficient"),
    ("cuda", F32, 64, H100, "cuda_efficient"),
    ("cuda", F64, 64, H100, "torch"),
    ("cuda", BF16, 64, A100, "cuda_flash"),
    ("cuda", F32, 64, A100, "cuda_efficient"),
    ("cuda", F16, 128, RTX4090, "cuda_flash"),
    ("cuda", F16, 192, RTX4090, "cuda_flash"),
    ("cuda", F16, 256, RTX4090, "cuda_efficient"),
    ("cuda", F16, 64, T4, "cuda_efficient"),
    ("cuda", F32, 64, T4, "cuda_efficient"),
    ("cuda", BF16, 64, NO_FLASH, "cuda_efficient"),
    ("cuda", BF16, 64, T4, "torch"),  # the memory-efficient kernel has no bf16 kernel below sm80
    ("cuda", BF16, 64, GpuFacts((7, 0)), "torch"),
    ("cuda", BF16, 64, ROCM, "cuda_flash"),  # PyTorch's fused kernels on ROCm (AOTriton)
    ("cuda", F16, 256, ROCM, "cuda_flash"),
    ("cuda", F16, 512, ROCM, "cuda_efficient"),
    ("cuda", F32, 64, ROCM, "cuda_efficient"),
    ("cuda", F64, 64, ROCM, "torch"),
    ("cuda", BF16, 64, GpuFacts((9, 4), flash_built=False, rocm=True), "torch"),
    ("mps", F32, 64, None, "torch"),
]


@pytest.mark.parametrize(("device", "dtype", "head_dim", "gpu", "name"), CHOICES)
def test_kernel_choice_table(device, dtype, head_dim, gpu, name):
    assert kernel_for(device, dtype, head_dim, gpu).name == name


def test_override_comes_first_and_is_read_at_every_call(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("DS_RING_KERNEL", raising=False)
    assert block.select_kernel(cpu, F32, 64) is fused.CPU_FLASH
    monkeypatch.setenv("DS_RING_KERNEL", "torch")
    assert block.select_kernel(cpu, F32, 64) is chunked.CHUNKED
    assert kernel_for("cuda", BF16, 64, H100, "torch") is chunked.CHUNKED
    monkeypatch.delenv("DS_RING_KERNEL")
    assert block.select_kernel(cpu, F32, 64) is fused.CPU_FLASH
    with pytest.raises(ValueError, match="DS_RING_KERNEL='flash3' names no block kernel"):
        kernel_for("cpu", F32, 64, None, "flash3")


TOLERANCE = {F64: 1e-12, F32: 2e-5, BF16: 3e-2}


@pytest.mark.parametrize("tile_bytes", [chunked.TILE_BYTES, 7 * 5 * 8], ids=["one tile", "uneven tiles"])
@pytest.mark.parametrize("kernel", [fused.CPU_FLASH, chunked.CHUNKED], ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [F64, F32, BF16], ids=str)
@pytest.mark.parametrize(("shape", "causal"), SHAPES)
def test_kernel_matches_oracle(monkeypatch, kernel, dtype, shape, causal, tile_bytes):
    monkeypatch.setattr(chunked, "TILE_BYTES", tile_bytes)
    check_against_oracle(kernel, dtype, shape, causal, "cpu", TOLERANCE[dtype])


@pytest.mark.parametrize("kernel", [fused.CPU_FLASH, chunked.CHUNKED], ids=lambda k: k.name)
@pytest.mark.parametrize(("shape", "causal"), SHAPES)
def test_kernel_on_token_major_views_matches_oracle(kernel, shape, causal):
    """``[b, h, s, d]`` views of ``[b, s, h, d]`` memory, as the attention hands the kernels its shards."""
    check_against_oracle(kernel, F64, shape, causal, "cpu", TOLERANCE[F64], token_major=True)


def test_tiling_stays_within_its_budget():
    for batch_heads in (1, 3, 64, 5000):
        for m, n in ((1, 1), (7, 1000), (1000, 7), (4096, 4096), (8192, 3)):
            for causal in (False, True):
                for scores, itemsize in ((1, 4), (2, 4), (2, 8)):
                    if causal and m != n:
                        continue
                    t = chunked.tiling(batch_heads, m, n, causal, itemsize, scores=scores, budget=4096)
                    assert t.matrices * t.rows * t.keys * itemsize * scores <= 4096, (batch_heads, m, n, t)
                    assert 1 <= t.matrices <= batch_heads and 1 <= t.rows <= m and 1 <= t.keys <= n, t
                    assert not causal or t.rows == t.keys, t


@pytest.mark.parametrize("causal", [False, True])
def test_pure_torch_kernel_never_holds_more_than_a_tile_of_scores(monkeypatch, causal):
    """64 × 64 scores per (batch, head) would be 16 KiB each; tensors of the block are 1 KiB; budget 2 KiB."""
    monkeypatch.setattr(chunked, "TILE_BYTES", 2048)
    q, k, v, dout = (torch.randn(1, 2, 64, 2) for _ in range(4))
    with LargestOutput() as seen:
        out, lse = chunked.CHUNKED.forward(q, k, v, causal, 0.5)
        chunked.CHUNKED.backward(dout, q, k, v, out, lse, causal, 0.5)
    assert seen.nbytes <= 2048, seen.nbytes


@pytest.mark.parametrize("kernel", [fused.CUDA_FLASH, fused.CUDA_EFFICIENT], ids=lambda k: k.name)
@pytest.mark.parametrize(("shape", "causal"), [((2, 3, 40, 20, 40), True), ((1, 4, 33, 64, 70), False)])
def test_cuda_wrappers_accept_their_arguments_on_meta_tensors(kernel, shape, causal):
    batch, heads, m, d, n = shape
    q = torch.empty(batch, heads, m, d, dtype=F16, device="meta")
    k, v = (torch.empty(batch, heads, n, d, dtype=F16, device="meta") for _ in range(2))
    out, lse = kernel.forward(q, k, v, causal, 0.125)
    assert (out.shape, out.dtype) == (q.shape, F16)
    assert lse.shape == (batch, heads, m)
    grads = kernel.backward(torch.empty_like(out), q, k, v, out, lse, causal, 0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
