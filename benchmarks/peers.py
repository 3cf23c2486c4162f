"""The libraries the benchmarks compare against: pinned, installed (``install-peers``), called (README.md)."""

import os
import subprocess
import sys
import types
from typing import Any

import deepspeed
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from torch import Tensor

from benchmarks.common import AttentionFn, Case, Skip, pairs_dilated, useful_gflop

RAP, DAP = "ring-attention-pytorch==0.5.20", "dilated-attention-pytorch==0.2.0"
PEERS = [RAP, DAP, "einops>=0.8.0", "beartype", "jaxtyping"]  # installed with --no-deps
RAP_BUCKET = 1024  # ring_flash_attn's default bucket_size


def install() -> int:
    print(f"benchmarks: installing {' '.join(PEERS)} (--no-deps)", flush=True)
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *PEERS], check=False).returncode


def sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None = None) -> Tensor:
    """PyTorch SDPA on ``[batch, seq, heads, head_dim]`` tensors."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def missing(requirement: str, exc: ImportError) -> Skip:
    return Skip(f"{requirement} is not installed ({exc}): run `python -m benchmarks install-peers`")


def rap_attention(case: Case) -> AttentionFn:
    """ring-attention-pytorch's pure-PyTorch ring path on contiguous shards (``benchmarks/SUITE.md``)."""
    if case.segment_lengths is not None:
        raise Skip("ring-attention-pytorch has no dilated attention")
    try:
        from ring_attention_pytorch import ring_flash_attn
    except ImportError as exc:
        raise missing(RAP, exc) from exc
    p, causal, bucket = case.world, case.causal, lambda q: min(RAP_BUCKET, q.shape[1])
    return lambda q, k, v, *_: ring_flash_attn(q, k, v, None, causal, bucket(q), p > 1, False, None, p)


def deepspeed_attention(case: Case, rank: int, group: Any) -> AttentionFn:
    """DeepSpeed's ``DistributedAttention`` (Ulysses) over ``group`` with SDPA as its local attention."""
    if case.segment_lengths is not None:
        raise Skip("SDPA, DistributedAttention's local attention here, has no dilation")
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed(dist_backend="gloo")
    local = lambda q, k, v, *args, **kwargs: sdpa(q, k, v, case.causal)
    ds_attn = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)
    return lambda q, k, v, segs, rates: ds_attn(q, k, v, 0)


def dap_attention(case: Case) -> AttentionFn:
    """dilated-attention-pytorch's ``DilatedAttention``, its xformers kernel SDPA in this process (README.md)."""
    segs = case.segment_lengths or ()
    if any(case.seq % w for w in segs):
        raise Skip(f"dilated-attention-pytorch needs seq % w == 0 for every w in {list(segs)}")
    _install_fake_xformers()
    try:
        from dilated_attention_pytorch.dilated_attention import DilatedAttention
    except ImportError as exc:
        raise missing(DAP, exc) from exc
    module = DilatedAttention(segment_lengths=list(segs), dilation_rates=list(case.dilation_rates or ()))
    return lambda q, k, v, segs, rates: module(q, k, v, is_causal=case.causal)


def flop(case: Case) -> float:
    """Useful fwd+bwd GFLOP of one call; dap splits the heads among the branches."""
    if case.impl != "dap":
        return useful_gflop(case)
    segs, rates = case.segment_lengths or (), case.dilation_rates or ()
    return useful_gflop(case, pairs_dilated(case.seq, case.heads, segs, rates, case.causal, split_heads=True))


def _install_fake_xformers() -> None:
    """A CPU stand-in for ``xformers.ops`` in this process: ``memory_efficient_attention`` runs SDPA."""
    ops = types.SimpleNamespace(LowerTriangularMask=type("LowerTriangularMask", (), {}), AttentionOp=object)

    def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None):
        if p or (attn_bias is not None and not isinstance(attn_bias, ops.LowerTriangularMask)):
            raise NotImplementedError(f"fake xformers: dropout {p} / attn_bias {type(attn_bias).__name__}")
        return sdpa(query, key, value, attn_bias is not None, scale)  # LowerTriangularMask: causal

    ops.memory_efficient_attention = memory_efficient_attention  # a name in sys.modules imports without a path
    sys.modules.update({"xformers": types.SimpleNamespace(ops=ops), "xformers.ops": ops})
