"""Which collectives a ``torch.distributed`` backend runs: a table, read alike on every rank.

Whether a span exchange takes the backend's collective or the point-to-point path is a decision
every rank must make the same way (one rank in a collective while another posts sends waits for
the timeout). So it is made from what every rank has (the backend's name, the kind of exchange,
the dtype), never from an error one rank happened to see. The table holds for torch >= 2.4 (gloo
runs reduce-scatter asynchronously from 2.3 on); a backend not listed (``ucc``, ``xccl``, custom)
takes the point-to-point path, which needs only ``batch_isend_irecv``.
"""

from __future__ import annotations

import torch

__all__ = ["COLLECTIVES", "runs_collective"]

_STANDARD = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int32, torch.int64,
     torch.bool}
)  # fmt: skip
_MPI = frozenset({torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})

COLLECTIVES: dict[str, tuple[frozenset[str], frozenset[torch.dtype]]] = {
    "gloo": (frozenset({"all_gather", "reduce_scatter", "all_to_all"}), _STANDARD),
    "nccl": (frozenset({"all_gather", "reduce_scatter", "all_to_all"}), _STANDARD),
    # ProcessGroupMPI has no all_gather_into_tensor or reduce-scatter; its dtypes are MPI's.
    "mpi": (frozenset({"all_to_all"}), _MPI),
}
"""backend name → (exchanges it runs as collectives, dtypes it runs them for)."""


def runs_collective(backend: str, kind: str, dtype: torch.dtype) -> bool:
    """Whether ``backend`` runs the ``kind`` exchange (``"all_gather"``, ``"reduce_scatter"``,
    ``"all_to_all"``) on ``dtype`` tensors as its own collective; else the point-to-point path."""
    kinds, dtypes = COLLECTIVES.get(str(backend).lower(), (frozenset(), frozenset()))
    return kind in kinds and dtype in dtypes
