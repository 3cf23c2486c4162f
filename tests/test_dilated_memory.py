"""Dilated attention never materialises a seq × seq matrix: peak memory measured in a fresh process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # two fresh 32K-token processes (~35 s of one core): CI's second step

_WORKER = textwrap.dedent(
    """
    import json, resource, sys, torch
    import ds_ring
    torch.set_num_threads(1)
    seq, backward = int(sys.argv[1]), sys.argv[2] == "1"
    q, k, v = (torch.randn(1, seq, 2, 16, requires_grad=backward) for _ in range(3))
    ds_ring.dilated_attention(q[:, :256], k[:, :256], v[:, :256], [128], [1])  # warm the kernel up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = ds_ring.dilated_attention(q, k, v, [256, 1024], [1, 4], causal=True)
    if backward:
        out.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mib": (peak - base) / 1024}))
    """
)


def _extra_mib(seq: int, backward: bool) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, str(seq), "1" if backward else "0"],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])["extra_mib"]


def test_peak_memory_is_linear_in_sequence_length():
    seq = 32768
    dense_scores_mib = seq * seq * 4 / 2**20  # one fp32 score matrix per head: 4096 MiB
    tensors_mib = seq * 2 * 16 * 4 / 2**20  # one [seq, heads, head_dim] fp32 tensor: 4 MiB
    forward = _extra_mib(seq, backward=False)
    both = _extra_mib(seq, backward=True)
    # O(seq): a few dozen tensor-sized buffers at most, orders of magnitude below one score matrix.
    assert forward < 40 * tensors_mib, forward
    assert both < 60 * tensors_mib, both
    assert both < dense_scores_mib / 10


_DENSE_WORKER = textwrap.dedent(
    """
    import json, os, resource, sys, torch
    import ds_ring
    torch.set_num_threads(1)
    seq, heads, head_dim = int(sys.argv[1]), 8, 64
    q, k, v = (torch.randn(1, seq, heads, head_dim, requires_grad=True) for _ in range(3))
    small = [x[:, :256].detach().requires_grad_() for x in (q, k, v)]
    ds_ring.dilated_attention(*small, causal=True).sum().backward()  # warm the kernel up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ds_ring.dilated_attention(q, k, v, causal=True).sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mib": (peak - base) / 1024, "kernel": os.environ.get("DS_RING_KERNEL")}))
    """
)


def test_pure_torch_kernel_stays_in_the_flash_memory_class():
    """``DS_RING_KERNEL=torch``, dense causal 8K fwd+bwd, 8 heads × 64, fp32: a few q-shards of peak extra
    memory (was ~518 when the pure-torch kernel formed each block's score matrix)."""
    seq = 8192
    q_shard_mib = seq * 8 * 64 * 4 / 2**20  # 16 MiB
    done = subprocess.run(
        [sys.executable, "-c", _DENSE_WORKER, str(seq)], capture_output=True, text=True, timeout=240, check=True,
        env={**os.environ, "DS_RING_KERNEL": "torch", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    extra = json.loads(done.stdout.strip().splitlines()[-1])["extra_mib"]
    assert extra <= 12 * q_shard_mib, f"{extra:.1f} MiB = {extra / q_shard_mib:.1f} q-shards"
