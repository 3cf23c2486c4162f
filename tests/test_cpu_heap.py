"""ds_ring fixes glibc's mmap threshold on a CPU rank (``ds_ring/cpu_heap.py``): freed tensors leave the RSS.

Two ranks in one launch: rank 0 opts out (``DS_RING_MMAP_THRESHOLD=off``), rank 1 runs with the default. Both run a
CPU attention call (the call that applies the setting), then free an 8 MiB tensor that sits in glibc's heap under its
default dynamic threshold; the RSS it leaves behind is read from ``/proc/self/status``: no timing. The setting's
rules (opt-out, glibc's own variable, other C libraries, a bad value) run in-process against a recording libc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ds_ring import cpu_heap
from ds_ring.comm.job import process
from ds_ring.cpu_heap import DEFAULT_THRESHOLD, ENV, configure_cpu_heap, heap_setting
from tests.dist import run_distributed

MIB = 1 << 20


def _rss_mib() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _retained_mib() -> float:
    """RSS left after freeing an 8 MiB tensor allocated after an 8 MiB one was freed (glibc's dynamic threshold
    then serves it from the heap) and before a small one that stays live above it (so it is not the heap's top)."""
    import ctypes

    import torch

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _rss_mib()
    first = torch.empty(2 * MIB).fill_(1.0)  # 2M floats: 8 MiB, touched
    del first
    second = torch.empty(2 * MIB).fill_(1.0)
    above = torch.empty(256).fill_(1.0)
    del second
    retained = _rss_mib() - before
    del above
    return retained


def _rank(rank: int, world_size: int) -> dict:
    import torch

    import ds_ring

    if rank == 0:
        os.environ[ENV] = "off"
    before = heap_setting()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=g, requires_grad=True) for _ in range(3))
    ds_ring.ring_dilated_attention(q, k, v, causal=True).sum().backward()
    return {"before": before, "after": heap_setting(), "retained_mib": _retained_mib()}


@pytest.mark.skipif(cpu_heap._glibc() is None, reason="glibc only")
def test_cpu_rank_sets_the_threshold_and_freed_tensors_leave_the_rss() -> None:
    opted_out, default = run_distributed(_rank, 2)
    assert default["before"] is None and opted_out["before"] is None  # nothing set before ds_ring's first call
    assert default["after"].threshold == DEFAULT_THRESHOLD
    assert opted_out["after"].threshold is None and ENV in opted_out["after"].reason
    assert default["retained_mib"] < 2, default
    # The same allocations keep the block resident under glibc's default: the check above can fail.
    assert opted_out["retained_mib"] > 6, opted_out


class _Libc:
    """Records mallopt / malloc_trim calls; ``accepts`` is what mallopt returns (1: done)."""

    def __init__(self, accepts: int = 1) -> None:
        self.calls: list[tuple] = []
        self.accepts = accepts

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return self.accepts

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> _Libc:
    fake = _Libc()
    monkeypatch.setattr(cpu_heap, "_glibc", lambda: fake)
    monkeypatch.setattr(process(), "heap", None)
    for name in (ENV, "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_default_sets_mmap_and_trim_thresholds_once(libc: _Libc) -> None:
    assert configure_cpu_heap().threshold == DEFAULT_THRESHOLD
    assert libc.calls == [("mallopt", -3, DEFAULT_THRESHOLD), ("mallopt", -1, DEFAULT_THRESHOLD), ("malloc_trim", 0)]
    configure_cpu_heap()
    assert len(libc.calls) == 3  # once per process


def test_an_explicit_threshold_is_kept_by_later_default_calls(libc: _Libc) -> None:
    configure_cpu_heap(65536)
    assert configure_cpu_heap().threshold == 65536 and len(libc.calls) == 3


def test_environment_picks_the_threshold(libc: _Libc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1048576")
    assert configure_cpu_heap().threshold == 1048576 and libc.calls[0] == ("mallopt", -3, 1048576)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (ENV, "off"),
        (ENV, "0"),
        ("MALLOC_MMAP_THRESHOLD_", "65536"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1"),
    ],
)
def test_opt_out_and_glibcs_own_setting_leave_the_allocator_alone(
    libc: _Libc, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    setting = configure_cpu_heap()
    assert setting.threshold is None and setting.reason and libc.calls == []


def test_other_c_libraries_and_refusals_are_recorded(libc: _Libc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_heap, "_glibc", lambda: None)
    assert configure_cpu_heap().reason == "the C library is not glibc"
    monkeypatch.setattr(cpu_heap, "_glibc", lambda: _Libc(accepts=0))
    assert "refused" in configure_cpu_heap(64 * MIB).reason


@pytest.mark.parametrize("value", ["lots", "-5"])
def test_a_bad_value_raises_naming_the_variable(libc: _Libc, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=ENV):
        configure_cpu_heap()
