"""Whole-model long context: the parts of a model that grow with the sequence, run in tiles.

* :mod:`.loss`: LM head + cross-entropy tile by tile (``[tokens, vocab]`` never held);
* :mod:`.mlp`: a gated MLP over tiles of tokens, activations recomputed per tile in the backward;
* :mod:`.zero`: ZeRO-3 weights gathered once per tiled computation, gradients handed back once;
* :mod:`.compute`: any token-wise function, or a loss, over tiles (DeepSpeed ALST's tiled names run on it);
* :mod:`.offload`: gradient-checkpoint inputs kept on the host or on disk until their recompute.

:mod:`ds_ring.integrations.hf.long_context` applies them to a Hugging Face model.
"""

from ds_ring.tiles.compute import tiled_loss, tiled_recompute
from ds_ring.tiles.cross_entropy import tiled_cross_entropy_sum
from ds_ring.tiles.mlp import gated_mlp_parts, tiled_gated_mlp
from ds_ring.tiles.offload import DiskStore, HostStore, make_store, offloaded_checkpoint

__all__ = [
    "tiled_cross_entropy_sum",
    "tiled_gated_mlp",
    "gated_mlp_parts",
    "tiled_recompute",
    "tiled_loss",
    "DiskStore",
    "HostStore",
    "make_store",
    "offloaded_checkpoint",
]
