"""The position ids of a vision-language model's language model under ds_ring's cut, and what its attention checks.

The cut (:meth:`~ds_ring.integrations.hf.vision.VisionLanguage._cut`) hands the language model this rank's rows of the
whole sequence's position ids: MRoPE ids only where a rotary of the language model reads ``mrope_section`` (EXAONE
4.5's 1-D RoPE text model crashed on them when its text config named MRoPE sections), its ``[b, s/p]`` ids otherwise;
3-axis MRoPE ids with the text row transformers' language models strip (``[4, b, s/p]``), ids of another count of
axes as they are (HunYuan-VL's XD-RoPE: 4 axes, and its language model raises on a fifth row). The attention's
position check reads the cut's text positions where a language model hands its layers the MRoPE rows (GLM-4V-MoE;
it was refused: the temporal row is not the tokens' positions) or, after ids without a text row, no positions
(HunYuan-VL); 3-D ids of any other origin are refused, naming the fix. The zoo runs the three families equal on 2
ranks (``-m slow`` here).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests import vlm_zoo


def _cut(family: str) -> tuple:
    """The family's tiny model on the meta device, registered for one process: its VisionLanguage and language
    model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from ds_ring.integrations.hf.vision import vision_language

    config = vlm_zoo.tiny_config(family)
    assert "mrope_section" in config.text_config.rope_parameters, family
    with torch.device("meta"):
        model = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]._from_config(config)
    vision = vision_language(model, SimpleNamespace(sequence_parallel_group=None), "contiguous")
    return vision, vision.language_model


def test_mrope_ids_go_only_to_a_language_model_whose_rotary_reads_them():
    embeds = torch.zeros(2, 8, 4)
    exaone, language_model = _cut("exaone4_5")
    _, cut = exaone._cut(language_model, (), {"inputs_embeds": embeds, "position_ids": torch.arange(8)[None]})
    assert not exaone.mrope and torch.equal(cut["position_ids"], torch.arange(8)[None])
    qwen, language_model = _cut("qwen2_vl")
    _, cut = qwen._cut(language_model, (), {"inputs_embeds": embeds, "position_ids": torch.arange(8)[None]})
    assert qwen.mrope and cut["position_ids"].shape == (4, 2, 8)


def test_the_mrope_rows_the_cut_handed_are_read_by_their_text_row():
    vision, language_model = _cut("glm4v_moe")
    mrope = torch.stack([torch.tensor([0, 1, 1, 1, 2, 3, 4, 5])] * 3)[:, None].expand(3, 2, 8)
    _, cut = vision._cut(language_model, (), {"inputs_embeds": torch.zeros(2, 8, 4), "position_ids": mrope})
    handed = cut["position_ids"]
    assert handed.shape == (4, 2, 8) and torch.equal(handed[1:], mrope)
    assert torch.equal(vision.text_positions(handed[1:]), torch.arange(8).expand(2, 8))
    assert vision.text_positions(handed[1:] + 1) is None  # not the rows it handed: the attention refuses them
    assert torch.equal(vision.batch["position_ids"], torch.arange(8).expand(2, 8))  # for a layer passing none


def test_xd_rope_ids_of_four_axes_go_without_a_text_row_and_the_attention_reads_the_cuts():
    vision, language_model = _cut("hunyuan_vl")
    assert vision.mrope_axes == 4
    xd = torch.stack([torch.arange(8), torch.tensor([0, 1, 0, 1, 0, 1, 6, 7])] * 2)[:, None].expand(4, 2, 8)
    _, cut = vision._cut(language_model, (), {"inputs_embeds": torch.zeros(2, 8, 4), "position_ids": xd})
    assert torch.equal(cut["position_ids"], xd)
    assert torch.equal(vision.batch["position_ids"], torch.arange(8).expand(2, 8))  # what its attention reads


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_exaone_4_5_glm_4v_moe_and_hunyuan_vl_equal_the_whole_model():
    outcomes, skipped = vlm_zoo.run(["exaone4_5", "glm4v_moe", "hunyuan_vl"], list(vlm_zoo.STRATEGIES))
    assert not skipped and len(outcomes) == 9 and {o.status for o in outcomes} == {"equal"}, (outcomes, skipped)
