"""glibc's heap on a CPU rank: freed tensors go back to the OS, so the memory per rank is the live tensors'.

glibc's default mmap threshold starts at 128 KiB and rises to the size of every mmap'ed block freed (up to 32 MiB),
so after the first large tensor is freed, tensors of that size come from the heap, and freed heap blocks between
live ones stay resident: the RSS of an attention fwd+bwd counts them (docs/performance.md, "Activation memory per
rank": Ulysses at 4 ranks 8.9 q-shards against 5.3 with the threshold fixed). :func:`configure_cpu_heap` fixes the
mmap threshold (and the trim threshold) once per process, so every block of at least that size is mapped on
allocation and unmapped on free.

ds_ring calls it where a CPU rank starts (``ds_ring.initialize`` / the Hugging Face integration on gloo) and on the
first attention call on CPU tensors. Never for CUDA tensors: a GPU job's host memory is mostly pinned buffers from
CUDA's own allocator, which glibc's threshold does not touch, and nothing was measured there.

Opt out with ``DS_RING_MMAP_THRESHOLD=off``; ``DS_RING_MMAP_THRESHOLD=<bytes>`` picks another threshold. glibc's
own ``MALLOC_MMAP_THRESHOLD_`` (or the ``glibc.malloc.mmap_threshold`` tunable), when set, wins: it is left alone.
Nothing happens off glibc (musl, macOS)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass

from ds_ring.comm.job import process

__all__ = ["DEFAULT_THRESHOLD", "ENV", "HeapSetting", "configure_cpu_heap", "heap_setting"]

ENV = "DS_RING_MMAP_THRESHOLD"
"""Environment variable: ``off`` leaves glibc's allocator alone; an integer is the threshold in bytes."""

DEFAULT_THRESHOLD = 131072
"""Bytes: blocks of at least this size are mmap'ed and returned on free (glibc's own starting value, kept)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


@dataclass(frozen=True)
class HeapSetting:
    """What :func:`configure_cpu_heap` did: ``threshold`` in bytes when it set glibc's mmap and trim thresholds,
    else ``None`` with ``reason`` saying why not."""

    threshold: int | None
    reason: str


_lock = threading.Lock()


def heap_setting() -> HeapSetting | None:
    """The setting this process made (its :class:`~ds_ring.comm.job.Job` keeps it), or ``None`` before
    :func:`configure_cpu_heap` ran."""
    return process().heap


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``gnu_get_libc_version``), else ``None``."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError off glibc
    except (OSError, AttributeError):
        return None
    return libc


def _requested(threshold: int | None) -> HeapSetting:
    """The threshold to set (``reason`` empty) or why none, from the argument and the environment."""
    if threshold is not None:
        return HeapSetting(threshold, "")
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return HeapSetting(None, "glibc's mmap threshold is set in the environment")
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("off", "0", "no", "false"):
        return HeapSetting(None, f"{ENV}={value}")
    if not value:
        return HeapSetting(DEFAULT_THRESHOLD, "")
    try:
        return HeapSetting(int(value), "")
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: give a threshold in bytes (e.g. {DEFAULT_THRESHOLD}) or 'off'") from None


def configure_cpu_heap(threshold: int | None = None) -> HeapSetting:
    """Fix glibc's mmap and trim thresholds at ``threshold`` bytes (default: ``DS_RING_MMAP_THRESHOLD``, else
    :data:`DEFAULT_THRESHOLD`) and return freed heap pages to the OS once.

    Without ``threshold`` this runs once per process: later calls return the first one's setting, so a threshold
    set explicitly before (a benchmark's) is kept. With ``threshold`` it always applies. Raises ``ValueError`` for a
    ``DS_RING_MMAP_THRESHOLD`` that is neither ``off`` nor a positive integer."""
    owner = process()
    with _lock:
        if threshold is None and owner.heap is not None:
            return owner.heap
        wanted = _requested(threshold)
        if wanted.threshold is not None and wanted.threshold <= 0:
            raise ValueError(f"mmap threshold {wanted.threshold}: give a positive number of bytes, or {ENV}=off")
        libc = _glibc() if wanted.threshold is not None else None
        if wanted.threshold is None:
            owner.heap = wanted
        elif libc is None:
            owner.heap = HeapSetting(None, "the C library is not glibc")
        elif libc.mallopt(_M_MMAP_THRESHOLD, wanted.threshold) != 1:
            owner.heap = HeapSetting(None, f"glibc refused mmap threshold {wanted.threshold} (at most 32 MiB)")
        else:
            libc.mallopt(_M_TRIM_THRESHOLD, wanted.threshold)
            libc.malloc_trim(0)
            owner.heap = wanted
        return owner.heap
