"""The one internal interface of ds_ring its integrations use, besides the public API (``import ds_ring``):
what an adapter of another framework needs from inside (the call entry, the ds_config reader, the topology's
groups and order, agreement and collectives, the DeepSpeed glue, the patches, the recurrent and tiled pieces).
``tests/test_import_graph.py`` holds ``ds_ring/integrations/`` to ``ds_ring``, this module and themselves."""

from ds_ring.calls import attend, topology_placement
from ds_ring.comm.agree import agree
from ds_ring.comm.collectives import all_gather, all_reduce
from ds_ring.comm.group_ranks import group_rank, group_size
from ds_ring.comm.job import process
from ds_ring.comm.spans import group_members
from ds_ring.compiler.custom_ops import differentiable_op, lookup, register
from ds_ring.config import SECTION, DsConfig, LongContextConfig, RingAttentionConfig, read_ds_config, read_section
from ds_ring.engine.gradient_scale import mark_parameters, parameter_gradient_scale
from ds_ring.engine.initialize import deepspeed_config_for, init_distributed
from ds_ring.engine.patches import Patch, keep_attribute, set_attribute, set_item, undo_all
from ds_ring.engine.preemption import Preemption
from ds_ring.loss import sequence_parallel_cross_entropy, sequence_parallel_mean
from ds_ring.parallel.groups import control_world
from ds_ring.parallel.order import gather_sequence, order_chunks, shard_sequence
from ds_ring.parallel.topology import Topology, sequence_group
from ds_ring.recurrent.exchange import gather_summaries, tie
from ds_ring.recurrent.mixers import delta_rule_scan, selective_scan, ssd_scan
from ds_ring.recurrent.pieces import ShardPieces, shard_pieces
from ds_ring.recurrent.scan import carry_states, causal_conv
from ds_ring.tiles import gated_mlp_parts, make_store, offloaded_checkpoint, tiled_cross_entropy_sum, tiled_gated_mlp
from ds_ring.tiles.compute import tiled_loss, tiled_recompute

__all__ = [
    "DsConfig",
    "LongContextConfig",
    "Patch",
    "Preemption",
    "RingAttentionConfig",
    "SECTION",
    "ShardPieces",
    "Topology",
    "agree",
    "all_gather",
    "all_reduce",
    "attend",
    "carry_states",
    "causal_conv",
    "control_world",
    "deepspeed_config_for",
    "delta_rule_scan",
    "differentiable_op",
    "gated_mlp_parts",
    "gather_sequence",
    "gather_summaries",
    "group_members",
    "group_rank",
    "group_size",
    "init_distributed",
    "keep_attribute",
    "lookup",
    "make_store",
    "mark_parameters",
    "offloaded_checkpoint",
    "order_chunks",
    "parameter_gradient_scale",
    "process",
    "read_ds_config",
    "read_section",
    "register",
    "selective_scan",
    "sequence_group",
    "sequence_parallel_cross_entropy",
    "sequence_parallel_mean",
    "set_attribute",
    "set_item",
    "shard_pieces",
    "shard_sequence",
    "ssd_scan",
    "tie",
    "tiled_cross_entropy_sum",
    "tiled_gated_mlp",
    "tiled_loss",
    "tiled_recompute",
    "topology_placement",
    "undo_all",
]
