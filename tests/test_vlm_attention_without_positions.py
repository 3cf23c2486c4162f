"""A vision-language model whose decoder layers pass no ``position_ids`` on to the attention: the cut's positions.

Cohere Compass's language model reads its (MRoPE) ``position_ids`` for the rotary embeddings and hands its decoder
layers only those embeddings, so ds_ring's attention gets no ``position_ids`` from the call, and the batch of a
vision-language model has none either (the model computes its own from the whole sequence). While the language model
runs, :class:`~ds_ring.integrations.hf.vision.VisionLanguage` holds this rank's rows of the whole sequence's text
positions (``batch``), which the attention reads when its call has none; it was refused ("the model passed no
position_ids to its attention") before. On 2 ranks with the zoo's tiny Cohere Compass (images across the shard
boundary): the attention module is called without ``position_ids``, the cut's are this rank's rows of ``0..S-1`` while
the language model runs and gone after it, and one step equals the whole model (loss and every gradient).
"""

from __future__ import annotations

import pytest
import torch

from ds_ring.testing import rank_results, spawn_ranks
from tests import vlm_zoo

FAMILY = "cohere_compass"


def _ranks(rank: int, world: int) -> dict:
    import transformers

    import ds_ring
    from ds_ring.integrations.hf import register_with_transformers, shard_batch
    from ds_ring.parallel.order import shard_sequence

    transformers.logging.set_verbosity_error()
    model = vlm_zoo.build(FAMILY, attention="sdpa")
    full = vlm_zoo.batch(FAMILY, model)
    config = {"ring_attention": {"strategy": "ring", "timeout_s": 60}}
    topology = ds_ring.Topology(*ds_ring.load_config(config).degrees(world))
    session = register_with_transformers(model, config=config, topology=topology)
    calls = []

    def record(_module, _args, kwargs):
        calls.append((kwargs.get("position_ids"), session.vision.batch.get("position_ids")))

    attention = model.model.language_model.layers[0].self_attn
    handle = attention.register_forward_pre_hook(record, with_kwargs=True)
    try:
        sharded = shard_batch(session, full)
        with torch.no_grad():
            model(**{k: v for k, v in sharded.items() if k != "shift_labels"})
        after = dict(session.vision.batch)
    finally:
        handle.remove()
        session.close()
        model.set_attn_implementation("eager")
    given, cut = calls[0]
    text = shard_sequence(torch.arange(vlm_zoo.SEQ).expand(vlm_zoo.BATCH, -1), topology, layout="contiguous", dim=1)
    seen = {
        "attention called without position_ids": given is None,
        "cut positions are the shard's rows": cut is not None and torch.equal(cut, text),
        "gone after the language model": after == {},
    }
    outcomes = vlm_zoo.run_family(rank, world, FAMILY, ["ring"])
    return {"seen": seen, "outcomes": [(o.status, o.detail) for o in outcomes]}


@pytest.mark.slow  # 31 s on 2 cores at a load of 18: CI's second step
@pytest.mark.timeout(1200)
def test_attention_without_position_ids_reads_the_cut_positions_and_equals_the_whole_model():
    for rank, result in enumerate(rank_results(spawn_ranks(_ranks, 2, timeout_s=1200))):
        assert all(result["seen"].values()), (rank, result["seen"])
        assert [status for status, _ in result["outcomes"]] == ["equal"], (rank, result["outcomes"])
