"""Pure tensor math: block kernels that return the LSE, the LSE merge, dilated attention.

Imports nothing above it in ds_ring and never ``torch.distributed``.
"""

from ds_ring.kernels.block import block_backward, block_forward, kernel_for, select_kernel
from ds_ring.kernels.dilated import dilated_attention
from ds_ring.kernels.merge import merge, merge_

__all__ = ["block_backward", "block_forward", "dilated_attention", "kernel_for", "merge", "merge_", "select_kernel"]
