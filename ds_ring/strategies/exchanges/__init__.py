"""K/V exchanges: how the K/V blocks of a spanning segment move among the members of its span.

``ring`` passes them rank to rank (:mod:`~ds_ring.strategies.exchanges.ring`), ``allgather`` gathers them
at once (:mod:`~ds_ring.strategies.exchanges.allgather`); each module registers its exchange with
:func:`ds_ring.strategies.sharded.register_exchange`. They live under the strategies (not in
:mod:`ds_ring.comm`) because they compute on the blocks they move, with the strategies' block kernels and
shard plans; ``comm`` stays below everything that computes attention.
"""
