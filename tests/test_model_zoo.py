"""transformers' causal-LM zoo: every family equals the whole model, or is refused for the reason the docs state.

:mod:`tests.zoo` builds each family tiny (float64, random weights) and compares ds_ring on 2 ranks (ring and
Ulysses) with the whole model on one process: loss and each parameter's gradient against its own scale. No family
may be *wrong*, *crash* or lack a reference; a refusal must give the reason :data:`EXPECTED_REFUSALS` names for that
family. ``docs/model_zoo.md`` is written by the same code (``python -m tests.zoo``); the every-family run writes the
table again and fails, with the diff, where it differs from the committed page.

The default run checks :data:`REPRESENTATIVE` (one family per path: windows given only by the mask, soft-capping,
latent attention, attention without ``position_ids``, MoE, state-space / short-convolution / lightning layers run
sequence-parallel, and one per refusal); ``pytest -m zoo`` (run by ``.ci/run``) checks every family.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.zoo import STRATEGIES, Outcome, assert_every_family, assert_expected, families, run, table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "model_zoo.md"
"""The committed table, which a run of every family must reproduce."""

REASONS = {
    "sequence mixer": r"mixes information along the sequence other than through attention",
    "own attention code": r"computes attention in its own code",
    "chunked mask": r"is given a mask with chunked attention",
    "mask built on": r"uses its attention mask as a tensor",
    "padded positions": r"position embedding with padding_idx",
    "bidirectional": r"attends bidirectionally but ring_attention.causal is True",
    "mask of masks": r"is given a mask with an OR of masks",
    "positions counted": r"computes positions from the shard's own token index",
    "no cut point": r"finds no language model in it|and no language model of its own",
}
"""Why ds_ring refuses a family: a key of :data:`EXPECTED_REFUSALS` → the message it gives."""

EXPECTED_REFUSALS: dict[str, str] = {
    **dict.fromkeys(["axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4"], "mask built on"),
    **dict.fromkeys(
        [
            "bailing_hybrid",
            "inkling_text",
            "inkling2_text",
            "inkling2_loop_text",
            "lfm2_moe",
            "qwen4_exp",
            "qwen4_exp_text",
            "recurrent_gemma",
            "zamba",
            "zaya",
        ],
        "sequence mixer",
    ),  # fmt: skip
    # an image tower whose output its decoder takes in itself (GIT's, Phi-4-multimodal's): no call to cut before
    **dict.fromkeys(["git", "phi4_multimodal"], "no cut point"),
    "blt": "bidirectional",  # its cross-attention between bytes and patches
    **dict.fromkeys(
        [
            "big_bird",
            "bloom",
            "cpmant",
            "doge",  # its attention calls an AttentionInterface of its own, which ds_ring does not replace
            "falcon",
            "gpt_neo",
            "gpt_neox_japanese",
            "megatron-bert",
            "mpt",
            "openai-gpt",
            "rembert",
            "roformer",
            "rwkv",
            "trocr",
            "xglm",
            "xlm",
        ],
        "own attention code",
    ),  # fmt: skip
    **dict.fromkeys(
        ["camembert", "data2vec-text", "roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "xmod"],
        "padded positions",
    ),
    **dict.fromkeys(["llama4", "llama4_text"], "chunked mask"),
    # decoders of encoder-decoder families: their position embedding numbers the tokens it is given from 0
    **dict.fromkeys(
        [
            "bart",
            "blenderbot",
            "blenderbot-small",
            "marian",
            "mbart",
            "musicgen",
            "musicgen_melody",
            "pegasus",
            "plbart",
        ],
        "positions counted",
    ),
}
"""Family → the key of :data:`REASONS` it is refused for (on every strategy)."""

REPRESENTATIVE = [
    "llama", "qwen2_moe", "phimoe", "gemma2", "deepseek_v3", "nemotron", "stablelm", "gpt_bigcode", "mixtral",
    "jamba", "mamba", "lfm3", "minimax", "qwen3_next", "doge", "llama4_text", "roberta", "gpt_neo",
]  # fmt: skip


def _own_attention_code(family: str) -> bool:
    """Whether this transformers release declares the family's attention its own (no attention backend): then
    refusing it as "own attention code" is right here, whatever a newer release does (Nemotron in 5.0)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family], None)
    return cls is not None and getattr(cls, "_supports_attention_backend", True) is False


def _mixer_of_an_older_release(outcome) -> bool:
    """A state-space / convolution / lightning layer refused because this transformers release predates the one the
    sequence-parallel recurrent layers follow (``RECURRENT_SINCE``): right here, whatever a newer release does."""
    from ds_ring.integrations.hf.recurrent import recurrent_supported

    return not recurrent_supported() and bool(re.search(REASONS["sequence mixer"], outcome.detail))


def _expected(outcome: Outcome) -> str | None:
    """The reason (a regular expression) :data:`EXPECTED_REFUSALS` names for the outcome's family, or the reason a
    refusal is right in this transformers release; ``None``: equal expected."""
    expected = EXPECTED_REFUSALS.get(outcome.family)
    if expected is None and outcome.status == "refused" and _mixer_of_an_older_release(outcome):
        expected = "sequence mixer"
    if expected is None and outcome.status == "refused" and _own_attention_code(outcome.family):
        expected = "own attention code"
    return None if expected is None else REASONS[expected]


@pytest.mark.slow  # CI's second step; its `zoo` run checks every family
@pytest.mark.timeout(3600)
def test_representative_families_equal_the_whole_model_or_are_refused_for_their_reason():
    outcomes, not_built = run(REPRESENTATIVE, list(STRATEGIES))
    assert_expected(outcomes, _expected, not_built, "not built")


@pytest.mark.zoo
@pytest.mark.timeout(5400)
def test_every_family_equals_the_whole_model_or_is_refused_and_the_table_is_this_run():
    assert_every_family(run, families(), list(STRATEGIES), _expected, table, PAGE, "tests.zoo")
