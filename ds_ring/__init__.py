"""ds_ring: ring dilated attention and sequence parallelism for DeepSpeed.

The attention API (functions, modules, topology) needs only ``torch.distributed``; the names that
need DeepSpeed (``load_config``, ``RingAttentionConfig``, ``initialize``) are imported on first use,
so ``import ds_ring`` stays light.
"""

from importlib import import_module
from typing import Any

from ds_ring.attention import MultiheadRingDilatedAttention, RingDilatedAttention
from ds_ring.calls import ring_dilated_attention, sequence_parallel_attention
from ds_ring.engine.checkpoint import load_checkpoint, save_checkpoint, save_rank_checkpoint
from ds_ring.hooks import Event, register_hook
from ds_ring.kernels import dilated_attention, merge
from ds_ring.loss import sequence_parallel_cross_entropy
from ds_ring.monitor import NumericsError, RingMonitor, run_main
from ds_ring.parallel.order import gather_sequence, shard_sequence
from ds_ring.parallel.topology import Topology
from ds_ring.reference import dilated_attention_reference

_WITH_DEEPSPEED = {
    "load_config": "ds_ring.config",
    "RingAttentionConfig": "ds_ring.config",
    "initialize": "ds_ring.engine.initialize",
    "StepAbandoned": "ds_ring.engine.preemption",
}

__all__ = [
    "Event",
    "MultiheadRingDilatedAttention",
    "NumericsError",
    "RingAttentionConfig",
    "RingDilatedAttention",
    "RingMonitor",
    "StepAbandoned",
    "Topology",
    "dilated_attention",
    "dilated_attention_reference",
    "gather_sequence",
    "initialize",
    "load_checkpoint",
    "load_config",
    "merge",
    "register_hook",
    "ring_dilated_attention",
    "run_main",
    "save_checkpoint",
    "save_rank_checkpoint",
    "sequence_parallel_attention",
    "sequence_parallel_cross_entropy",
    "shard_sequence",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _WITH_DEEPSPEED:
        return getattr(import_module(_WITH_DEEPSPEED[name]), name)
    raise AttributeError(f"module 'ds_ring' has no attribute {name!r}")
