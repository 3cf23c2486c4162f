"""``TensorCensus``: the tensors alive at the peak, by module (``recompute:`` inside a backward) or gradient node;
freed storages leave the count, small ones are not counted."""

from __future__ import annotations

import torch
from torch import nn

from ds_ring.monitor import TensorCensus

MIB = 2**20


def test_the_peak_holds_what_lived_together_and_names_its_makers():
    with TensorCensus() as census:
        a = torch.empty(MIB // 4)  # 1 MiB
        b = torch.zeros(2 * MIB // 4)  # 2 MiB: 3 MiB live
        del a, b
        c = torch.ones(MIB // 4)  # 1 MiB alone: not a new peak
        torch.ones(10)  # below min_bytes
        del c
    assert census.peak.bytes == 3 * MIB
    assert census.peak.by_label == {"empty": MIB, "zeros": 2 * MIB}
    assert census.peak.table(top=1) == [("zeros", 2.0), ("other", 1.0)]


def test_labels_name_the_module_and_the_gradient_node():
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh())
    x = torch.randn(512, 256, requires_grad=True)
    with TensorCensus(model) as census:
        y = model(x)
    assert "1 tanh" in census.peak.by_label, census.peak.by_label  # 2 MiB made by module "1"
    leaf = torch.randn(MIB, requires_grad=True)  # 4 MiB
    with TensorCensus() as census:
        doubled = leaf * 2
        doubled.sum().backward()
    assert census.peak.by_label == {"mul": 4 * MIB, "grad:MulBackward0 mul": 4 * MIB}, census.peak.by_label
    del y, doubled
