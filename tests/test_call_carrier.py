"""One carrier for an attention call (docs/design.md §Walks): the ds_config's section, the modules and the
functions all build one :class:`~ds_ring.strategies.AttentionCall`, by keyword; its branch lists are validated
once; its cache key and the fields its ranks agree on are derived from its fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ds_ring
import ds_ring.kernels.dilation as dilation
from ds_ring.strategies import AttentionCall
from ds_ring.strategies.base import FIELDS, NOT_AGREED
from tests.dist import run_distributed

SECTION = {"segment_lengths": [16, 32], "dilation_rates": [1, 2], "layout": "contiguous", "timeout_s": 60}


def test_positional_spelling_is_refused() -> None:
    with pytest.raises(TypeError):
        AttentionCall([16], [1])  # type: ignore[misc]


def test_module_and_function_forms_build_the_same_call() -> None:
    module = ds_ring.RingDilatedAttention([16, 32], [1, 2], causal=True, layout="contiguous", timeout_s=60)
    options = dict(segment_lengths=[16, 32], dilation_rates=[1, 2], causal=True, timeout_s=60, group=None)
    assert module.call == AttentionCall.of(options)
    assert module.call.segment_lengths == (16, 32) and repr(module.call.segment_lengths) == "[16, 32]"


def test_section_call_is_made_once_and_reused_by_modules() -> None:
    from ds_ring.config import CALL_FIELDS, read_section

    section = read_section({"ring_attention": SECTION}).section
    assert section.call() is section.call()
    module = ds_ring.RingDilatedAttention()
    module.configure(**section.call_settings(), strategy=section.strategy)
    assert {name: getattr(module.call, name) for name in CALL_FIELDS} == section.call_settings()
    assert module.call.segment_lengths is section.call().segment_lengths  # the validated list itself, not a copy


def test_key_and_agreement_derive_from_every_field() -> None:
    base = AttentionCall()
    changed = dict(
        segment_lengths=[8], dilation_rates=[2], causal=True, scale=0.5, communication="allgather", layout="zigzag",
        head_offset=2, return_lse=True, timeout_s=9.0, cu_seqlens=torch.tensor([0, 3, 8]), window=4,
        sinks=torch.zeros(4), softcap=30.0, bidirectional_spans=torch.tensor([0, 1, 1, 0]), prefix_lengths=[3],
    )  # fmt: skip
    assert set(changed) == set(FIELDS), "a new field of AttentionCall: add it here"
    assert {"timeout_s"} == NOT_AGREED
    described = base.described()
    for name, value in changed.items():
        other = dataclasses.replace(base, **{name: value}, **({"dilation_rates": [2]} if name == "segment_lengths"
                                                             else {"segment_lengths": [8]} if name == "dilation_rates"
                                                             else {}))  # fmt: skip
        assert other.described()[name] != described[name], name
        hash(tuple(other.described().values()))  # every value keys a dict
    assert dataclasses.replace(base, scale=1).described() == dataclasses.replace(base, scale=1.0).described()


def _validations(rank: int, world_size: int) -> list[int]:
    """Validations of the branch lists, counted after each step from a ds_config section to a second call."""
    from ds_ring.config import read_section
    from ds_ring.engine.initialize import install

    counted: list[int] = []
    real = dilation._validated_branches
    dilation._validated_branches = lambda s, r: (counted.append(1), real(s, r))[1]
    topology = ds_ring.Topology(ring=world_size)
    section = read_section({"ring_attention": SECTION}).section
    steps = [len(counted)]
    section.check(world_size=world_size, num_heads=4, num_kv_heads=2, seq_len=64)
    model = torch.nn.Sequential(ds_ring.RingDilatedAttention())
    install(model, section, topology)
    steps.append(len(counted))
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 64 // world_size, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    for _ in range(2):
        model[0](q, k, v).sum().backward()
        steps.append(len(counted))
    return steps


def test_branch_lists_are_validated_once() -> None:
    """From the section to the kernel on two ranks: one validation (it was 5: the section, its check, the module,
    the call's options and a second plan with other arguments)."""
    for steps in run_distributed(_validations, 2, timeout=120):
        assert steps == [1, 1, 1, 1], steps
