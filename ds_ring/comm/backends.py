"""Which collectives a ``torch.distributed`` backend runs: a table, read alike on every rank.

Whether a span exchange takes the backend's collective or the point-to-point path is a decision
every rank must make the same way (one rank in a collective while another posts sends waits for
the timeout). So it is made from what every rank has (the backend's name, the kind of exchange,
the dtype), never from an error one rank happened to see. The table holds for torch >= 2.4 (gloo
runs reduce-scatter asynchronously from 2.3 on); a backend not listed (``ucc``, ``xccl``, custom)
takes the point-to-point path, which needs only ``batch_isend_irecv``.

``dist.get_backend`` names either one backend (``"nccl"``) or one per device type
(``"cpu:gloo,cuda:nccl"``, what ``init_process_group()`` without a backend and DeepSpeed start): the
backend looked up is the one of the data's device type, so CUDA tensors of such a group take NCCL's
collectives (ring / tree / NVLS), not ``p - 1`` point-to-point transfers.
"""

from __future__ import annotations

import torch

__all__ = ["COLLECTIVES", "runs_collective", "device_backend"]

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


def device_backend(backend: str, device_type: str) -> str:
    """The backend that moves ``device_type`` tensors under ``backend`` as ``dist.get_backend`` names it:
    ``"nccl"`` → ``"nccl"``; ``"cpu:gloo,cuda:nccl"`` → ``"nccl"`` for ``"cuda"``, ``"gloo"`` for ``"cpu"``,
    ``""`` for a device type it lists no backend for. Lower case."""
    backend = str(backend).lower()
    if ":" not in backend:
        return backend
    devices = dict(part.strip().split(":", 1) for part in backend.split(",") if ":" in part)
    return devices.get(device_type, "")


def runs_collective(backend: str, kind: str, dtype: torch.dtype, device_type: str = "cpu") -> bool:
    """Whether ``backend`` (``dist.get_backend``'s name, per-device form included) runs the ``kind`` exchange
    (``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"``) on ``dtype`` tensors of ``device_type`` as its
    own collective; else the point-to-point path."""
    kinds, dtypes = COLLECTIVES.get(device_backend(backend, device_type), (frozenset(), frozenset()))
    return kind in kinds and dtype in dtypes
