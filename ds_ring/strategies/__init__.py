"""Strategies: how attention over sequence shards is computed and how K/V move between ranks.

Importing this package registers the built-in exchanges (``ring``, ``allgather``).
"""

from ds_ring.strategies import allgather, ring  # noqa: F401  (registration)
from ds_ring.strategies.plan import ShardPlan, plan_shards
from ds_ring.strategies.sharded import CommSpec, exchanges, get_exchange, register_exchange, sharded_attention

__all__ = [
    "CommSpec",
    "ShardPlan",
    "exchanges",
    "get_exchange",
    "plan_shards",
    "register_exchange",
    "sharded_attention",
]
