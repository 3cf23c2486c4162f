"""Hugging Face models through ``ds_ring.integrations.hf`` compute exactly what the whole model computes.

On 2 and 4 gloo ranks, for a Llama with GQA (8 heads, 4 K/V heads) and a Qwen2 (8 heads, 2 K/V
heads: fewer than the Ulysses degree at 4 ranks), batch 2, float64: the gathered logits, the loss
and every parameter gradient summed over the sequence group equal the unsharded model's, for ring
(contiguous and zigzag), all-gather, Ulysses, hybrid 2×2 and the dilated variants. The dilated
reference is the whole model with ``ds_ring.dilated_attention`` registered as its attention.

Packed batches (position ids restarting at 0 where a document begins, documents crossing shard
boundaries) equal every document run through the whole model on its own.
"""

import pytest
import torch

from ds_ring.integrations.hf import register_with_transformers
from tests.dist import CaseLog, run_distributed
from tests.hf_cases import (
    DILATED,
    MODELS,
    REFERENCE_DILATED,
    assert_same,
    documents_alone,
    ds_config,
    full_batch,
    register_reference_dilated,
    sequence_parallel,
    topology_for,
    whole_model,
)

CASES_2 = {
    "ring contiguous": {"strategy": "ring"},
    "ring zigzag": {"strategy": "ring", "layout": "zigzag"},
    "allgather": {"strategy": "allgather"},
    "ulysses": {"strategy": "ulysses"},
    "ulysses zigzag": {"strategy": "ulysses", "layout": "zigzag"},
    "ring dilated": {"strategy": "ring", **DILATED},
    "allgather dilated": {"strategy": "allgather", **DILATED},
    "ulysses dilated": {"strategy": "ulysses", **DILATED},
}
CASES_4 = {
    **CASES_2,
    "hybrid 2x2": {"strategy": "hybrid", "ulysses_degree": 2, "ring_degree": 2},
    "hybrid 2x2 allgather": {"strategy": "hybrid", "ulysses_degree": 2, "ring_degree": 2, "communication": "allgather"},
    "hybrid 2x2 dilated": {"strategy": "hybrid", "ulysses_degree": 2, "ring_degree": 2, **DILATED},
}


DOCUMENTS = [0, 11, 20, 32]


def _packed(batch: dict) -> dict:
    positions = torch.cat([torch.arange(b - a) for a, b in zip(DOCUMENTS[:-1], DOCUMENTS[1:], strict=True)])
    return {**batch, "position_ids": positions.expand(batch["input_ids"].shape[0], -1)}


def _rank(rank: int, world: int, cases: dict[str, dict]) -> dict[str, list[str]]:
    logs = {"unpacked": CaseLog(), "packed": CaseLog()}
    register_reference_dilated()
    batches = {"unpacked": full_batch()}
    batches["packed"] = _packed(batches["unpacked"])
    topologies = {}
    for model_name, build in MODELS.items():
        model = build()
        expected = {
            ("unpacked", "dense"): whole_model(model, batches["unpacked"]),
            ("unpacked", "dilated"): whole_model(model, batches["unpacked"], REFERENCE_DILATED),
            ("packed", "dense"): documents_alone(model, batches["packed"], DOCUMENTS),
            ("packed", "dilated"): documents_alone(model, batches["packed"], DOCUMENTS, REFERENCE_DILATED),
        }
        for kind, batch in batches.items():
            for case, section in cases.items():
                with logs[kind].case(f"{kind}: {model_name}, {case}, {world} ranks"):
                    topology = topology_for(section, world, topologies)
                    session = register_with_transformers(model, config=ds_config(**section), topology=topology)
                    try:
                        got = sequence_parallel(model, batch, session)
                    finally:
                        session.close()
                    assert_same(got, expected[kind, "dilated" if "segment_lengths" in section else "dense"])
    return {kind: log.failures for kind, log in logs.items()}


# 4 ranks: CI's second step (time)
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"])
def failures(request) -> dict[str, list[str]]:
    """Every case at one world size, ranks started once for the unpacked and packed tests."""
    world = request.param
    results = run_distributed(_rank, world, timeout=150, cases=CASES_2 if world == 2 else CASES_4)
    return {kind: [f for per_rank in results for f in per_rank[kind]] for kind in ("unpacked", "packed")}


def _report(failed: list[str]) -> str:
    return f"{len(failed)} failures; first:\n" + "\n".join(failed[:2])


@pytest.mark.timeout(180)
def test_hf_models_match_the_whole_model(failures):
    assert not failures["unpacked"], _report(failures["unpacked"])


@pytest.mark.timeout(180)
def test_packed_batches_match_documents_run_alone(failures):
    assert not failures["packed"], _report(failures["packed"])
