"""Host offload overlaps compute (issue 33, defect 6): the device-to-host copy runs on a side stream that waits
for the compute stream, an event marks its end and the compute stream never waits for it; the backward
prefetches the next layer's input on the side stream and the compute stream waits on that copy's event only
when it unpacks it. A recording fake stands in for CUDA (meta tensors play the GPU's)."""

from __future__ import annotations

import torch

from ds_ring.tiles.offload import CudaCopies, HostStore


class Recorder(CudaCopies):
    """Every stream and event call, as ``(who, what, argument)``."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current, self.events = "main", 0

    def _stream(self, name: str):
        recorder = self

        class Stream:
            def wait_stream(self, other):
                recorder.log.append((name, "wait_stream", other.name))

            def wait_event(self, event):
                recorder.log.append((name, "wait_event", event.name))

        stream = Stream()
        stream.name = name
        return stream

    def pinned_like(self, tensor):
        self.log.append((self.current, "pinned", tuple(tensor.shape)))
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    def empty_on(self, host, device):
        return torch.empty(host.shape, dtype=host.dtype, device="meta")

    def new_stream(self, device):
        self.log.append(("-", "new_stream", str(device)))
        return self._stream("side")

    def current_stream(self, device):
        return self._stream(self.current)

    def on(self, stream):
        recorder = self

        class On:
            def __enter__(self):
                recorder.previous, recorder.current = recorder.current, stream.name

            def __exit__(self, *exc):
                recorder.current = recorder.previous

        return On()

    def new_event(self):
        recorder, self.events = self, self.events + 1

        class Event:
            name = f"event{self.events}"

            def record(self, stream):
                recorder.log.append((stream.name, "record", self.name))

        return Event()

    def keep(self, tensor, stream):
        self.log.append((stream.name, "keep", tuple(tensor.shape)))


def test_pack_copies_on_a_side_stream_with_an_event():
    cuda = Recorder()
    store = HostStore(cuda)
    entry = store.pack(torch.empty(2, 3, device="meta"))
    assert ("side", "wait_stream", "main") in cuda.log  # the copy waits for the tensor to be complete
    assert ("side", "record", "event1") in cuda.log and entry.copied.name == "event1"
    assert ("side", "keep", (2, 3)) in cuda.log  # the allocator keeps the tensor until the copy is done
    assert not [e for e in cuda.log if e[0] == "main" and e[1].startswith("wait")]  # compute never waits


def test_backward_prefetches_the_next_layer_and_waits_only_on_its_own_copy():
    cuda = Recorder()
    store = HostStore(cuda)
    layers = [store.pack(torch.empty(i + 1, 4, device="meta")) for i in range(3)]  # forward: layers 0, 1, 2
    cuda.log.clear()
    back = store.unpack(layers[2])  # backward reaches layer 2 first
    assert back.shape == (3, 4)
    assert ("side", "wait_event", layers[2].copied.name) in cuda.log
    assert ("side", "wait_event", layers[1].copied.name) in cuda.log  # layer 1 prefetched
    assert layers[1].back is not None and layers[0].back is None
    assert [e for e in cuda.log if e[0] == "main" and e[1] == "wait_event"] == [
        ("main", "wait_event", layers[2].arrived.name)
    ]
    cuda.log.clear()
    store.unpack(layers[1])  # already on its way: no new copy of it, layer 0 prefetched
    assert ("side", "wait_event", layers[1].copied.name) not in cuda.log
    assert ("side", "wait_event", layers[0].copied.name) in cuda.log
    assert ("main", "wait_event", layers[1].arrived.name) in cuda.log
    assert len([e for e in cuda.log if e[1] == "new_stream"]) == 0  # one side stream per device, made once


def test_cpu_tensors_stay_where_they_are():
    cuda = Recorder()
    store = HostStore(cuda)
    x = torch.ones(3)
    assert store.unpack(store.pack(x)) is x and cuda.log == []
