"""How the ranks of a job are divided: rank-layout arithmetic, the process groups built from it, DeepSpeed's
``mpu`` view of them, where Ulysses groups fall on the hosts, and the order of a sequence's shards.

- :mod:`~ds_ring.parallel.layout`: :class:`RankLayout`, where every rank sits in ``data × ring × ulysses``
  (pure arithmetic);
- :mod:`~ds_ring.parallel.groups`: the process groups of a layout and their gloo twins for control traffic;
- :mod:`~ds_ring.parallel.topology`: :class:`Topology`, agreeing on the degrees and holding the groups;
- :mod:`~ds_ring.parallel.mpu`: :class:`DeepSpeedMpu`, the getters ``deepspeed.initialize(mpu=...)`` reads;
- :mod:`~ds_ring.parallel.ulysses_hosts`: the check that no Ulysses group spans several hosts;
- :mod:`~ds_ring.parallel.order`: the ``contiguous`` / ``zigzag`` order of a sequence's shards.

Nothing here imports the strategies or the integrations: they build on it.
"""

from ds_ring.parallel.layout import ROLES, RankLayout, rank_layout
from ds_ring.parallel.mpu import DeepSpeedMpu
from ds_ring.parallel.order import ORDERS, gather_sequence, shard_sequence
from ds_ring.parallel.topology import Topology, sequence_group

__all__ = [
    "ROLES",
    "ORDERS",
    "RankLayout",
    "rank_layout",
    "DeepSpeedMpu",
    "Topology",
    "sequence_group",
    "shard_sequence",
    "gather_sequence",
]
