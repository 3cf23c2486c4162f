"""``long_context.offload_recompute``: the activations a checkpointed layer's recompute saves go to the store, each
written once however many ops save it, and read back by the ops that use them; gradients equal plain autograd's.
The layer's inputs, mapped back from their files, give their pages back after the recompute and keep their values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_ring.hooks import register_hook
from ds_ring.tiles import offload
from ds_ring.tiles.offload import DiskStore, offloaded_checkpoint


def _layer(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = F.silu(x @ w1)
    return x + (h * h.sigmoid()) @ w2  # h is saved by three ops


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((64, 16), (16, 32), (32, 16))]


@pytest.mark.parametrize("recompute", [False, True])
def test_gradients_equal_plain_autograd_and_every_file_goes(recompute, tmp_path, monkeypatch):
    monkeypatch.setattr(offload, "RECOMPUTE_MIN_BYTES", 0)
    x, w1, w2 = (t.requires_grad_() for t in _inputs())
    want = torch.autograd.grad(_layer(_layer(x, w1, w2), w1, w2).square().sum(), (x, w1, w2))

    store = DiskStore(tmp_path)
    checkpoint = offloaded_checkpoint(store, recompute=recompute)
    events = []
    with register_hook(lambda e: events.append(e.op) if e.kind == "offload" else None):
        checkpoint(_layer, checkpoint(_layer, x, w1, w2), w1, w2).square().sum().backward()
    got = [t.grad for t in (x, w1, w2)]
    store.close()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    written = events.count("disk_write")
    # Each checkpoint keeps its three inputs; with recompute each layer's activations are written too, once each.
    assert written > 6 if recompute else written == 6, events
    assert written == events.count("disk_release"), events
    assert not list(tmp_path.iterdir())


def test_a_tensor_saved_by_several_ops_is_written_once(tmp_path, monkeypatch):
    monkeypatch.setattr(offload, "RECOMPUTE_MIN_BYTES", 0)
    store = DiskStore(tmp_path)
    hooks = offload._RecomputeSaves(store, 0)
    x = torch.randn(8, 8, requires_grad=True)
    h = x * 2  # not a leaf
    first, second = hooks.pack(h), hooks.pack(h)
    assert first is second
    assert hooks.pack(x) is x  # leaves stay where they are
    torch.testing.assert_close(hooks.unpack(first), h.detach())
    store.close()


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_dropped_pages_leave_resident_memory_and_come_back_with_their_values(tmp_path):
    store = DiskStore(tmp_path)
    original = torch.randn(16 * 2**20 // 4 * 4)  # 64 MiB
    entry = store.pack(original)
    mapped = store.unpack(entry)
    assert torch.equal(mapped, original)  # every page touched: resident
    resident = _rss_mib()
    other = original.clone()
    store.drop_pages([mapped, other, "not a tensor"])
    assert _rss_mib() < resident - 32 + 64  # the clone added 64 MiB; the mapping gave back its 64
    assert torch.equal(mapped, original) and torch.equal(other, original)
    store.close()
