"""ds_ring: ring dilated attention and sequence parallelism for DeepSpeed."""

from ds_ring.kernels import dilated_attention, merge
from ds_ring.reference import dilated_attention_reference

__all__ = ["dilated_attention", "dilated_attention_reference", "merge"]
__version__ = "0.1.0"
