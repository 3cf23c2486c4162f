"""``position_ids`` that differ from the tokens' positions by one offset, the same on every rank, are taken.

PaliGemma counts its positions from 1; RoPE sees only differences, so the model sharded with every rank's positions
moved by 1 equals the whole model called with ``arange(S) + 1``: a tiny float64 Llama on 2 gloo ranks, ring and
zigzag ring, logits, loss and every gradient. Positions of the shard's own length (``arange(s/p)`` on every rank,
offsets 0 and ``-s/p``) are refused on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_ring.integrations.hf import register_with_transformers, shard_batch
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.hf_cases import (
    SEQ,
    Result,
    assert_same,
    ds_config,
    full_batch,
    llama,
    sequence_parallel,
    shifted,
    topology_for,
)

STRATEGIES = {"ring": {"strategy": "ring"}, "ring zigzag": {"strategy": "ring", "layout": "zigzag"}}


def _whole_from_one(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Result:
    """The unsharded model with positions ``1..S``."""
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=torch.arange(1, SEQ + 1)[None])
    loss = F.cross_entropy(out.logits.flatten(0, 1), shifted(batch["labels"]).flatten(), ignore_index=-100)
    loss.backward()
    return Result(
        out.logits.detach(), out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    )


def _from_one(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the positions the model is given plus 1 (PaliGemma's count from 1)."""
    return args, {**kwargs, "position_ids": kwargs["position_ids"] + 1}


def _rank(rank: int, world: int) -> list[str]:
    log, topologies = CaseLog(), {}
    model, batch = llama(), full_batch()
    expected = _whole_from_one(model, batch)
    for strategy, section in STRATEGIES.items():
        topology = topology_for(section, world, topologies)
        with log.case(f"positions from 1, {strategy}"):
            session = register_with_transformers(model, config=ds_config(**section), topology=topology)
            handle = model.register_forward_pre_hook(_from_one, with_kwargs=True)
            try:
                got = sequence_parallel(model, batch, session)
            finally:
                handle.remove()
                session.close()
            assert_same(got, expected)
        with log.case(f"positions of the shard refused, {strategy}"):
            session = register_with_transformers(model, config=ds_config(**section), topology=topology)
            try:
                sharded = shard_batch(session, batch)
                with pytest.raises(ValueError, match="position_ids minus the positions of the rank's tokens"):
                    local = torch.arange(sharded["input_ids"].shape[1])[None]  # the shard's own length
                    model(**{k: v for k, v in sharded.items() if k != "shift_labels"} | {"position_ids": local})
            finally:
                session.close()
    return log.failures


@pytest.mark.timeout(300)
def test_one_offset_on_every_rank_is_taken_and_shard_positions_are_refused():
    assert_no_failures(run_distributed(_rank, 2, timeout=260))
