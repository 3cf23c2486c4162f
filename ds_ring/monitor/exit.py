"""End a training process cleanly: exit code 0 after success, non-zero after any error, never a hang.

At interpreter exit DeepSpeed and gloo intermittently abort in C++ static destructors
("terminate called without an active exception"), and after a communication failure the process
group cannot be torn down (that would wait on the dead peer). So :func:`run_main` ends the process
with ``os._exit`` once output is flushed: 0 when ``main`` returned, the ``SystemExit`` code it
raised, or 1 after logging any other error with the rank that raised it.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["run_main"]

logger = logging.getLogger("ds_ring.monitor")


def _rank() -> str:
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return str(torch.distributed.get_rank())
    return os.environ.get("RANK", "?")


def run_main(main: Callable[[], Any]) -> NoReturn:
    """Run ``main()``, then end the process with ``os._exit`` (after ``MPI_Finalize`` on success under mpirun)."""
    code = 0
    try:
        main()
    except SystemExit as exc:  # argparse errors, sys.exit(n): keep their code
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - every error ends the process non-zero, logged
        code = 1
        traceback.print_exc()
        logger.error("ds_ring: rank %s exiting with code 1 after %s: %s", _rank(), type(exc).__name__, exc)
    # A rank that skips MPI_Finalize is reported as crashed by mpirun: right after a failure only.
    if code == 0 and "mpi4py.MPI" in sys.modules:
        sys.modules["mpi4py.MPI"].Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
