"""Communication layer: the only code in ds_ring that calls torch.distributed transfers.

Every wait is bounded (see :mod:`ds_ring.comm.wait`) and fails with an error naming the rank,
the peer, the step and the op. Peers and spans are always *global* ranks. Before the first transfer of a
plan the ranks :func:`agree` on it (one small all-gather, cached per plan).
"""

from ds_ring.comm.agree import agree
from ds_ring.comm.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from ds_ring.comm.errors import CommError, CommTimeoutError
from ds_ring.comm.ring_comm import RingComm
from ds_ring.comm.wait import DEFAULT_TIMEOUT_S

__all__ = [
    "agree",
    "RingComm",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "CommError",
    "CommTimeoutError",
    "DEFAULT_TIMEOUT_S",
]
