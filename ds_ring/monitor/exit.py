"""End a training process cleanly: exit code 0 after success, non-zero after any error, never a hang.

At interpreter exit DeepSpeed and gloo intermittently abort in C++ static destructors
("terminate called without an active exception"), and after a communication failure the process
group cannot be torn down (that would wait on the dead peer). So :func:`run_main` ends the process
with ``os._exit`` once output is flushed: 0 when ``main`` returned, the ``SystemExit`` code it
raised, or 1 after logging any other error with the rank that raised it.

``os._exit`` skips ``atexit`` handlers, so whatever buffers output for later (W&B, Comet: see
:mod:`ds_ring.monitor.flush`) registers a flush with :func:`at_clean_exit`; :func:`run_main` runs
them first, on every path, each failure logged and all of them together bounded by
``flush_timeout_s`` (a flush stuck on a network never keeps the process alive).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from ds_ring.comm.job import process

__all__ = ["run_main", "at_clean_exit"]

logger = logging.getLogger("ds_ring.monitor")


def at_clean_exit(flush: Callable[[], Any]) -> Callable[[], None]:
    """Have :func:`run_main` call ``flush()`` before it ends the process (the process's
    :class:`~ds_ring.comm.job.Job` keeps it); returns a function undoing that."""
    key, flushes = id(flush), process().flushes
    flushes[key] = flush
    return lambda: flushes.pop(key, None)


def _run_flushes(timeout_s: float) -> None:
    """Call every registered flush in registration order, in a daemon thread given ``timeout_s`` seconds."""

    flushes = process().flushes

    def run() -> None:
        for flush in list(flushes.values()):
            try:
                flush()
            except Exception as exc:  # noqa: BLE001 - one failed flush must not stop the others or the exit
                logger.error("ds_ring: rank %s: flushing %r at exit failed: %s", _rank(), flush, exc)

    if not flushes:
        return
    worker = threading.Thread(target=run, name="ds_ring-exit-flush", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.error("ds_ring: rank %s: monitor flush still running after %s s; exiting without it", _rank(), timeout_s)


def _rank() -> str:
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return str(torch.distributed.get_rank())
    return os.environ.get("RANK", "?")


def run_main(main: Callable[[], Any], *, flush_timeout_s: float = 120.0) -> NoReturn:
    """Run ``main()``, run the :func:`at_clean_exit` flushes (bounded by ``flush_timeout_s`` seconds),
    then end the process with ``os._exit`` (after ``MPI_Finalize`` on success under mpirun)."""
    code = 0
    try:
        main()
    except SystemExit as exc:  # argparse errors, sys.exit(n): keep their code
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - every error ends the process non-zero, logged
        code = 1
        traceback.print_exc()
        logger.error("ds_ring: rank %s exiting with code 1 after %s: %s", _rank(), type(exc).__name__, exc)
    _run_flushes(flush_timeout_s)
    # A rank that skips MPI_Finalize is reported as crashed by mpirun: right after a failure only.
    if code == 0 and "mpi4py.MPI" in sys.modules:
        sys.modules["mpi4py.MPI"].Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
