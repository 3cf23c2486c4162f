"""ds_ring: ring dilated attention and sequence parallelism for DeepSpeed."""

from ds_ring.attention import MultiheadRingDilatedAttention, RingDilatedAttention
from ds_ring.functional import ring_dilated_attention
from ds_ring.kernels import dilated_attention, merge
from ds_ring.loss import sequence_parallel_cross_entropy
from ds_ring.reference import dilated_attention_reference
from ds_ring.sharding import gather_sequence, shard_sequence

__all__ = [
    "MultiheadRingDilatedAttention",
    "RingDilatedAttention",
    "dilated_attention",
    "dilated_attention_reference",
    "gather_sequence",
    "merge",
    "ring_dilated_attention",
    "sequence_parallel_cross_entropy",
    "shard_sequence",
]
__version__ = "0.1.0"
