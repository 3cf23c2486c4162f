"""Strategies: how attention over sequence shards is computed and how K/V move between ranks.

Importing this package registers the built-in exchanges (``ring``, ``allgather``: how a ring dimension
moves K/V blocks) and strategies, one line each. A strategy owns its rules: what it refuses
(:meth:`Strategy.check`), the degrees a ds_config may give it (:meth:`Strategy.check_degrees`) and its cost and
memory model (:meth:`Strategy.options`, :meth:`Strategy.cost`, :meth:`Strategy.memory_q_shards`), so a new one is
one module plus one :func:`register_strategy` call (here, or in the module that defines it: ``strategy="auto"``
registers itself in :mod:`ds_ring.auto`). This package never imports :mod:`ds_ring.auto`.
"""

from ds_ring.strategies.base import (
    DEFAULT_STRATEGY,
    AttentionCall,
    Bound,
    Degrees,
    Placement,
    Shape,
    Strategy,
    Target,
    get_strategy,
    register_strategy,
    strategy_names,
)
from ds_ring.strategies.exchanges import allgather, ring  # noqa: F401  (exchange registration)
from ds_ring.strategies.hybrid import Hybrid
from ds_ring.strategies.plan import ShardPlan, plan_shards
from ds_ring.strategies.ring import SequenceShards
from ds_ring.strategies.sharded import CommSpec, exchanges, get_exchange, register_exchange, sharded_attention
from ds_ring.strategies.ulysses import Ulysses

register_strategy(SequenceShards("ring"))
register_strategy(SequenceShards("allgather", exchange="allgather"))
register_strategy(Ulysses())
register_strategy(Hybrid())

__all__ = [
    "DEFAULT_STRATEGY",
    "AttentionCall",
    "Bound",
    "CommSpec",
    "Degrees",
    "Placement",
    "Shape",
    "ShardPlan",
    "Strategy",
    "Target",
    "exchanges",
    "get_exchange",
    "get_strategy",
    "plan_shards",
    "register_exchange",
    "register_strategy",
    "sharded_attention",
    "strategy_names",
]
