"""Find this process's rank from whichever launcher started it, as ``torch.distributed`` env vars.

``torchrun`` and the ``deepspeed`` launcher set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` themselves. Under SLURM (``srun``) and ``mpirun`` they are derived
here. DeepSpeed's own MPI discovery overwrites ``MASTER_ADDR`` with the host's external address;
this one keeps a ``MASTER_ADDR`` the user set (e.g. ``127.0.0.1``) and only falls back to rank 0's
hostname.

Across nodes, every launcher needs ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` on GPUs) set on each
node to the interface the nodes reach each other on; it is not derived here, as only the cluster knows it.
"""

from __future__ import annotations

import os
import socket

__all__ = ["discover_launch_env"]

_DEFAULT_PORT = "29500"


def _from_mpi() -> dict[str, str] | None:
    if "OMPI_COMM_WORLD_RANK" not in os.environ and "PMI_RANK" not in os.environ:
        return None
    from mpi4py import MPI  # the optional 'mpi' extra

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    master = os.environ.get("MASTER_ADDR") or comm.bcast(socket.gethostname(), root=0)
    return {
        "RANK": str(comm.Get_rank()),
        "WORLD_SIZE": str(comm.Get_size()),
        "LOCAL_RANK": str(local.Get_rank()),
        "LOCAL_WORLD_SIZE": str(local.Get_size()),
        "MASTER_ADDR": master,
        "MASTER_PORT": os.environ.get("MASTER_PORT", _DEFAULT_PORT),
    }


def _from_slurm() -> dict[str, str] | None:
    if "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return None
    master = os.environ.get("MASTER_ADDR")
    if not master:
        nodes = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "127.0.0.1"))
        master = nodes.split(",")[0].split("[")[0]
    return {
        "RANK": os.environ["SLURM_PROCID"],
        "WORLD_SIZE": os.environ["SLURM_NTASKS"],
        "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
        "MASTER_ADDR": master,
        "MASTER_PORT": os.environ.get("MASTER_PORT", _DEFAULT_PORT),
    }


def discover_launch_env() -> str:
    """Fill in the ``torch.distributed`` env vars when a launcher left them unset; returns which one did.

    Returns ``"env"`` (already set: torchrun / deepspeed), ``"mpi"``, ``"slurm"`` or ``"single"``
    (no launcher: a world of one on ``127.0.0.1``).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        return "env"
    for name, found in (("mpi", _from_mpi), ("slurm", _from_slurm)):
        values = found()
        if values is not None:
            os.environ.update(values)
            return name
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT", _DEFAULT_PORT),
    )  # fmt: skip
    return "single"
