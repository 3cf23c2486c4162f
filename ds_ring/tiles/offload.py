"""Offloaded checkpoints: the inputs gradient checkpointing keeps per layer wait on the host or on disk.

Gradient checkpointing keeps one ``[b, s/p, hidden]`` input per layer until the backward recomputes the
layer. :func:`offloaded_checkpoint` checkpoints a layer (reentrant: the input is a saved tensor) under
``torch.autograd.graph.saved_tensors_hooks`` that hand that input to a store:

* :class:`HostStore` copies it to pinned host memory on an accelerator (on a CPU it stays where it is);
* :class:`DiskStore` writes it to a file in a directory (unlinked at once: nothing outlives the process)
  from a writer thread with a bounded queue, and maps it back for the recompute, so it leaves resident
  memory on a CPU too.

An entry lives until its layer's backward reads it, or until the graph holding it is freed (a forward
without backward): nothing accumulates over steps (:attr:`live` counts the entries held).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["HostStore", "DiskStore", "offloaded_checkpoint", "make_store"]


class _Counted:
    """The entries a store holds (``live``) and has taken (``stored``): what tests read to see nothing leaks."""

    def __init__(self) -> None:
        self.live = 0
        self.stored = 0
        self._lock = threading.Lock()

    def _add(self, n: int) -> None:
        with self._lock:
            self.live += n
            self.stored += max(n, 0)


class HostStore:
    """Pinned host memory for accelerator tensors; CPU tensors are kept as they are (autograd owns every entry:
    it goes with the graph, so there is nothing to count or close)."""

    def close(self) -> None:
        """Nothing to release."""

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host, tensor.device

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, device = packed
        return host.to(device, non_blocking=True)


class _OnDisk:
    """One tensor in an unlinked file: the descriptor, where to put it back, and the write in flight."""

    def __init__(self, store: DiskStore, tensor: torch.Tensor) -> None:
        fd, path = tempfile.mkstemp(dir=store.directory, prefix="ds_ring_checkpoint_")
        os.unlink(path)  # the open descriptor keeps the data; the name never outlives this line
        self.fd, self.store = fd, store
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        store._add(1)
        self.written: Future = store._writer.submit(_write, fd, tensor.detach())
        self.written.add_done_callback(lambda _: store._slots.release())

    def read(self) -> torch.Tensor:
        self.written.result()
        if self.nbytes == 0:
            data = torch.empty(self.shape, dtype=self.dtype)
        else:  # private mapping: pages come from the file as the recompute reads them, and go with the tensor
            mapped = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            data = torch.frombuffer(mapped, dtype=torch.uint8).view(self.dtype).view(self.shape)
        self.close()
        return data.to(self.device)

    def close(self) -> None:
        if self.fd is not None:
            self.written.result()
            os.close(self.fd)
            self.fd = None
            self.store._add(-1)

    def __del__(self) -> None:
        self.close()


def _write(fd: int, tensor: torch.Tensor) -> None:
    data = tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    with os.fdopen(fd, "wb", closefd=False) as file:
        file.write(memoryview(data))


class DiskStore(_Counted):
    """Tensors written to unlinked files in ``directory`` by one writer thread, at most ``pending`` writes queued
    (a forward waits rather than hold more tensors in memory than that)."""

    def __init__(self, directory: str | os.PathLike, pending: int = 2) -> None:
        super().__init__()
        self.directory = os.fspath(directory)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_ring_offload")
        self._slots = threading.BoundedSemaphore(pending)

    def close(self) -> None:
        """Stop the writer thread once its queued writes are done (the store is not used after)."""
        self._writer.shutdown(wait=True)

    def pack(self, tensor: torch.Tensor) -> _OnDisk:
        self._slots.acquire()  # released when the write is done: a forward waits rather than queue more
        return _OnDisk(self, tensor)

    def unpack(self, entry: _OnDisk) -> torch.Tensor:
        return entry.read()


def make_store(where: str, directory: str | None = None) -> HostStore | DiskStore | None:
    """The store for ``offload_checkpoints`` = ``where`` (``"none"``: ``None``)."""
    if where == "none":
        return None
    return HostStore() if where == "host" else DiskStore(directory)


def offloaded_checkpoint(store: HostStore | DiskStore) -> Callable[..., Any]:
    """A gradient-checkpointing function (transformers' ``_gradient_checkpointing_func``) whose kept inputs wait
    in ``store``: ``fn(function, *args)`` runs ``function(*args)`` without keeping its activations, keeps the
    tensors of ``args`` in the store, and recomputes ``function`` in the backward (reentrant checkpointing)."""

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("use_reentrant", None)
        with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)

    return checkpoint
