"""Offloaded checkpoints: the inputs gradient checkpointing keeps per layer wait on the host or on disk.

Gradient checkpointing keeps one ``[b, s/p, hidden]`` input per layer until the backward recomputes the
layer. :func:`offloaded_checkpoint` checkpoints a layer (reentrant: the input is a saved tensor) under
``torch.autograd.graph.saved_tensors_hooks`` that hand that input to a store:

* :class:`HostStore` copies it to pinned host memory on an accelerator, on a side stream overlapped with
  compute, and prefetches it back one layer ahead in the backward (on a CPU it stays where it is);
* :class:`DiskStore` writes it to a file in a directory (unlinked at once: nothing outlives the process)
  from a writer thread with a bounded queue (on an accelerator the copy to pinned host memory runs on a side
  stream and the writer waits on its event only), and maps it back for the recompute, so it leaves resident
  memory on a CPU too.

An entry lives until its layer's backward reads it, or until the graph holding it is freed (a forward
without backward): nothing accumulates over steps (each entry taken and let go emits an ``"offload"``
event when hooks listen, :mod:`ds_ring.hooks`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

from ds_ring.comm.group_ranks import group_rank
from ds_ring.hooks import Event, emit, hooks_active

_LIBC = ctypes.CDLL(None, use_errno=True)

__all__ = ["HostStore", "CudaCopies", "DiskStore", "offloaded_checkpoint", "make_store"]


def _observe(op: str, nbytes: int) -> None:
    """Emit an ``"offload"`` event (``op``: ``"disk_write"`` when an entry is taken, ``"disk_release"`` when it
    is let go) when hooks listen: what tests count to see that nothing leaks."""
    if hooks_active():
        emit(Event(kind="offload", rank=group_rank(None), op=op, nbytes=nbytes))


class CudaCopies:
    """Every GPU call :class:`HostStore` makes (tests swap in a recording fake): pinned buffers, a side stream
    per device, events, copies."""

    def pinned_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def empty_on(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return torch.empty(host.shape, dtype=host.dtype, device=device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is not reused before ``stream``'s work queued so far is done."""
        tensor.record_stream(stream)


class _HostEntry:
    """One tensor in pinned memory: its device-to-host copy's event, and the host-to-device copy (prefetched
    or not) with its event."""

    def __init__(self, host: torch.Tensor, device: torch.device, copied: Any) -> None:
        self.host, self.device, self.copied = host, device, copied
        self.back: torch.Tensor | None = None
        self.arrived: Any = None


class HostStore:
    """Pinned host memory for accelerator tensors; CPU tensors are kept as they are (autograd owns every entry:
    it goes with the graph).

    Overlapped with compute: the device-to-host copy runs on a side stream (per device) that first waits for
    the compute stream (the tensor is complete), ``record_stream`` keeps the allocator off the tensor until
    the copy is done, and an event marks its end; the compute stream never waits for it. In the backward,
    unpacking one layer's input starts the host-to-device copy of the input packed before it (the next layer
    the backward reaches) on the side stream; the compute stream waits on that copy's event only when the
    layer is unpacked."""

    def __init__(self, cuda: CudaCopies | None = None) -> None:
        self.cuda = cuda or CudaCopies()
        self._streams: dict[torch.device, Any] = {}
        self._order: list[weakref.ref[_HostEntry]] = []  # packed entries, oldest first

    def close(self) -> None:
        """Nothing to release."""

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = self.cuda.new_stream(device)
        return self._streams[device]

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "cpu":
            return tensor
        side, compute = self._stream(tensor.device), self.cuda.current_stream(tensor.device)
        host = self.cuda.pinned_like(tensor)
        side.wait_stream(compute)
        with self.cuda.on(side):
            host.copy_(tensor, non_blocking=True)
            copied = self.cuda.new_event()
            copied.record(side)
        self.cuda.keep(tensor, side)
        entry = _HostEntry(host, tensor.device, copied)
        self._order = [ref for ref in self._order if ref() is not None] + [weakref.ref(entry)]
        return entry

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self._fetch(packed)
        earlier = [ref() for ref in self._order if ref() is not None]
        index = next((i for i, entry in enumerate(earlier) if entry is packed), 0)
        if index > 0:
            self._fetch(earlier[index - 1])  # prefetch: the layer the backward reaches next
        compute = self.cuda.current_stream(packed.device)
        compute.wait_event(packed.arrived)
        back, packed.back = packed.back, None
        self.cuda.keep(back, compute)
        self._order = [ref for ref in self._order if ref() is not None and ref() is not packed]
        return back

    unpack_again = unpack  # every unpack copies back (or returns the CPU tensor itself)

    def drop_pages(self, tensors: Sequence[Any]) -> None:
        """Nothing to give back: host entries are copies, device tensors are the allocator's."""

    def _fetch(self, entry: _HostEntry) -> None:
        """Start ``entry``'s host-to-device copy on the side stream, after its device-to-host copy (once)."""
        if entry.back is not None:
            return
        side = self._stream(entry.device)
        side.wait_event(entry.copied)
        with self.cuda.on(side):
            entry.back = self.cuda.empty_on(entry.host, entry.device)
            entry.back.copy_(entry.host, non_blocking=True)
            entry.arrived = self.cuda.new_event()
            entry.arrived.record(side)


class _OnDisk:
    """One tensor in an unlinked file: the descriptor, where to put it back, and the write in flight."""

    def __init__(self, store: DiskStore, tensor: torch.Tensor) -> None:
        fd, path = tempfile.mkstemp(dir=store.directory, prefix="ds_ring_checkpoint_")
        os.unlink(path)  # the open descriptor keeps the data; the name never outlives this line
        self.fd, self.store = fd, store  # the store (its writer thread) lives as long as its entries
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        _observe("disk_write", self.nbytes)
        tensor, copied = store._to_host(tensor.detach())
        self.written: Future = store._writer.submit(_write, fd, tensor, copied)
        self.written.add_done_callback(lambda _: store._slots.release())

    def read(self) -> torch.Tensor:
        """The tensor back (a private mapping of the file on a CPU); the file stays until :meth:`close`."""
        self.written.result()
        if self.nbytes == 0:
            data = torch.empty(self.shape, dtype=self.dtype)
        else:  # private mapping: pages come from the file as the recompute reads them, and go with the tensor
            mapped = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            data = torch.frombuffer(mapped, dtype=torch.uint8).view(self.dtype).view(self.shape)
        return data.to(self.device)

    def close(self) -> None:
        if self.fd is not None:
            self.written.result()
            os.close(self.fd)
            self.fd = None
            _observe("disk_release", self.nbytes)

    def __del__(self) -> None:
        self.close()


def _write(fd: int, tensor: torch.Tensor, copied: Any = None) -> None:
    """Write ``tensor`` (on the host) to ``fd``, once its device-to-host copy's event ``copied`` (if any) is done:
    the writer thread waits on that event only, never on a stream or the device."""
    if copied is not None:
        copied.synchronize()
    data = tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    with os.fdopen(fd, "wb", closefd=False) as file:
        file.write(memoryview(data))


class DiskStore:
    """Tensors written to unlinked files in ``directory`` by one writer thread, at most ``pending`` writes queued
    (a forward waits rather than hold more tensors in memory than that)."""

    def __init__(self, directory: str | os.PathLike, pending: int = 2, cuda: CudaCopies | None = None) -> None:
        self.directory = os.fspath(directory)
        self.cuda = cuda or CudaCopies()
        self._streams: dict[torch.device, Any] = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_ring_offload")
        self._slots = threading.BoundedSemaphore(pending)
        self._mapped: dict[int, tuple[StorageWeakRef, int]] = {}  # unpacked tensors' mappings: address -> bytes

    def close(self) -> None:
        """Stop the writer thread once its queued writes are done (the store is not used after)."""
        self._writer.shutdown(wait=True)

    def _to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``tensor`` on the host and the event its copy there ends with (``None``: it was there already).

        On an accelerator: an event recorded on the compute stream (the tensor is complete), a side stream (one
        per device) that waits for it and copies into pinned memory, ``record_stream`` to keep the allocator off
        the tensor until the copy is done, and an event on the side stream that the writer thread waits on.
        """
        if tensor.device.type == "cpu":
            return tensor, None
        if tensor.device not in self._streams:
            self._streams[tensor.device] = self.cuda.new_stream(tensor.device)
        side = self._streams[tensor.device]
        ready = self.cuda.new_event()
        ready.record(self.cuda.current_stream(tensor.device))
        side.wait_event(ready)
        with self.cuda.on(side):
            host = self.cuda.pinned_like(tensor)
            host.copy_(tensor, non_blocking=True)
            copied = self.cuda.new_event()
            copied.record(side)
        self.cuda.keep(tensor, side)
        return host, copied

    def pack(self, tensor: torch.Tensor) -> _OnDisk:
        self._slots.acquire()  # released when the write is done: a forward waits rather than queue more
        return _OnDisk(self, tensor)

    def unpack_again(self, entry: _OnDisk) -> torch.Tensor:
        """``entry``'s tensor, the entry kept for more reads (its file goes when the entry does)."""
        return entry.read()

    def unpack(self, entry: _OnDisk) -> torch.Tensor:
        data = entry.read()
        entry.close()  # the mapping keeps the pages it needs: the descriptor goes now
        if data.device.type == "cpu" and entry.nbytes:
            self._mapped = {ptr: known for ptr, known in self._mapped.items() if not known[0].expired()}
            self._mapped[data.data_ptr()] = (StorageWeakRef(data.untyped_storage()), entry.nbytes)
        return data

    def drop_pages(self, tensors: Sequence[Any]) -> None:
        """Give back the resident pages of the tensors among ``tensors`` that :meth:`unpack` mapped from their files
        (the others are left alone): unmodified pages of a private file mapping are read again from the file when
        next touched, so the tensors keep their values while they wait out of resident memory."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            known = self._mapped.get(tensor.untyped_storage().data_ptr())
            if known is None or known[0].expired() or tensor._version:  # written in place: its pages must stay
                continue
            _LIBC.madvise(
                ctypes.c_void_p(tensor.untyped_storage().data_ptr()), ctypes.c_size_t(known[1]), mmap.MADV_DONTNEED
            )
        self._mapped = {ptr: known for ptr, known in self._mapped.items() if not known[0].expired()}


def make_store(where: str, directory: str | None = None) -> HostStore | DiskStore | None:
    """The store for ``offload_checkpoints`` = ``where`` (``"none"``: ``None``)."""
    if where == "none":
        return None
    return HostStore() if where == "host" else DiskStore(directory)


class _Saved:
    """One activation a recompute saved, in a store: its entry, the stride to give it back, the storage it came
    from (weakly: a new tensor at a freed address is not the same one) and the tensor last read back (weakly:
    ops that saved the same tensor share one read while it lives)."""

    __slots__ = ("entry", "stride", "source", "last", "__weakref__")

    def __init__(self, entry: Any, tensor: torch.Tensor) -> None:
        self.entry, self.stride = entry, tensor.stride()
        self.source = StorageWeakRef(tensor.untyped_storage())
        self.last: weakref.ref[torch.Tensor] | None = None


class _RecomputeSaves:
    """``saved_tensors_hooks`` for a layer's recompute: an activation of ``min_bytes`` or more goes to ``store``
    once (several ops saving the same tensor share it); leaves (parameters, the layer's inputs, constants)
    and small tensors stay as they are."""

    def __init__(self, store: HostStore | DiskStore, min_bytes: int) -> None:
        self.store, self.min_bytes = store, min_bytes
        self._saved: weakref.WeakValueDictionary[tuple, _Saved] = weakref.WeakValueDictionary()

    def pack(self, tensor: torch.Tensor) -> Any:
        base = tensor if tensor._base is None else tensor._base
        if base.grad_fn is None or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        storage = tensor.untyped_storage()
        key = (
            storage.data_ptr(),
            tensor.storage_offset(),
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
            tensor._version,
        )
        saved = self._saved.get(key)
        if saved is None or saved.source.expired():
            saved = self._saved[key] = _Saved(self.store.pack(tensor), tensor)
        return saved

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        tensor = saved.last() if saved.last is not None else None
        if tensor is None:
            tensor = self.store.unpack_again(saved.entry)
            if tensor.stride() != saved.stride:
                tensor = torch.empty_strided(
                    tensor.shape, saved.stride, dtype=tensor.dtype, device=tensor.device
                ).copy_(tensor)
            saved.last = weakref.ref(tensor)
        return tensor


RECOMPUTE_MIN_BYTES = 1 << 20
"""Smaller activations of a recompute stay resident with ``recompute=True`` (bytes)."""


def offloaded_checkpoint(store: HostStore | DiskStore, recompute: bool = False) -> Callable[..., Any]:
    """A gradient-checkpointing function (transformers' ``_gradient_checkpointing_func``) whose kept inputs wait
    in ``store``: ``fn(function, *args)`` runs ``function(*args)`` without keeping its activations, keeps the
    tensors of ``args`` in the store, and recomputes ``function`` in the backward (reentrant checkpointing).

    With ``recompute``, the activations the recompute saves for the layer's backward (each of
    :data:`RECOMPUTE_MIN_BYTES` or more, not a leaf) go to ``store`` too and are read back by the backward op that
    uses them, so a layer's activations are not resident all at once during its backward.
    """
    hooks = _RecomputeSaves(store, RECOMPUTE_MIN_BYTES) if recompute else None

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("use_reentrant", None)
        if hooks is not None:
            function = _saving_to(hooks, function)
        with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)

    return checkpoint


def _saving_to(hooks: _RecomputeSaves, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` whose run with grad enabled (the backward's recompute; reentrant checkpointing runs the
    forward under ``no_grad``) saves through ``hooks``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            outputs = function(*args, **kwargs)
        # The layer's inputs are held by the checkpoint through its whole backward, but read again only near its
        # end (the first op's gradient): their pages wait in their files until then.
        hooks.store.drop_pages(args)
        return outputs

    return run
