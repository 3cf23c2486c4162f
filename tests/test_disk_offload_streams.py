"""The disk store's device-to-host copy (issue 33, item 10): on an accelerator it runs on a side stream after an
event recorded on the compute stream, into pinned memory, and the writer thread waits on that copy's event
only; CPU tensors go to the writer as they are. The recording CUDA stand-in of the host-store test."""

from __future__ import annotations

import os

import torch

from ds_ring.tiles.offload import DiskStore
from tests.test_host_offload_streams import Recorder


class DiskRecorder(Recorder):
    def pinned_like(self, tensor):
        recorder = self
        self.log.append((self.current, "pinned", tuple(tensor.shape)))

        class Pinned(torch.Tensor):
            def copy_(self, src, non_blocking=False):
                recorder.log.append((recorder.current, "copy", non_blocking))
                with torch._C.DisableTorchFunctionSubclass():
                    torch.Tensor.fill_(self, 7)
                return self

        return torch.zeros(tensor.shape, dtype=tensor.dtype).as_subclass(Pinned)

    def new_event(self):
        event, recorder = super().new_event(), self
        event.synchronize = lambda: recorder.log.append(("writer", "synchronize", event.name))
        return event


def test_disk_copy_runs_on_a_side_stream_and_the_writer_waits_on_its_event(tmp_path):
    cuda = DiskRecorder()
    store = DiskStore(tmp_path, cuda=cuda)
    entry = store.pack(torch.empty(2, 3, device="meta"))
    entry.written.result()
    assert cuda.log == [
        ("-", "new_stream", "meta"),
        ("main", "record", "event1"),  # the tensor is complete on the compute stream
        ("side", "wait_event", "event1"),
        ("side", "pinned", (2, 3)),
        ("side", "copy", True),  # device to pinned host, on the side stream
        ("side", "record", "event2"),
        ("side", "keep", (2, 3)),
        ("writer", "synchronize", "event2"),  # the writer waits on the copy only
    ]
    assert os.pread(entry.fd, 24, 0) == torch.full((2, 3), 7.0).numpy().tobytes()
    entry.close()
    store.close()


def test_disk_cpu_tensors_need_no_stream(tmp_path):
    cuda = DiskRecorder()
    store = DiskStore(tmp_path, cuda=cuda)
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(store.unpack(store.pack(x)), x) and cuda.log == []
    store.close()
