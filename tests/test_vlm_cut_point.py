"""Where ds_ring cuts a multimodal model, found by its structure, not its family: or why it cannot.

A model whose vision side has no ``vision_config`` is still cut before its language model: Fuyu (one linear layer over
the patches, its language model built from a nested ``text_config``), Chameleon and Emu3 (a VQ-VAE built from
``vq_config``: a *tower*, a sub-model with a config of its own). Refused before registration probes the model, naming
why: a tower feeding a decoder built from the model's own config (Chameleon: no call before the decoder takes only the
merged embeddings; Evolla's cross-attends to its protein encoder's output), a vision-language model inside with no
language model to cut before (Pi0), any
encoder-decoder (UDOP: no tower's config nested), and at the cut a language model given image features it merges
itself (Kosmos-2's ``image_embeds``). A text model built of sub-models (BLT) stays a text model. On 2 ranks (slow):
Fuyu and Granite 4 Vision (deepstack features as ``{layer: [image tokens, hidden]}``, cut to this rank's rows) equal the
whole model on ring / zigzag / Ulysses; Kosmos-2 is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests import vlm_zoo


def _meta(family: str) -> torch.nn.Module:
    """``family``'s model built on the meta device from its default config (no memory)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    config = CONFIG_MAPPING[family]()
    try:
        cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    except KeyError:  # BLT: a causal LM only
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls._from_config(config)


def test_a_model_without_vision_config_is_cut_before_its_language_model():
    from ds_ring.integrations.hf.vision import cut_point

    assert cut_point(vlm_zoo.build("fuyu"))[0] == "model.language_model"  # text_config nested, patches via a Linear
    assert cut_point(vlm_zoo.build("emu3"))[0] == "model.text_model"  # its VQ-VAE (vq_config) outside, a tower


def test_a_config_with_its_text_config_nested_is_refused_by_name_as_a_vision_language_one():
    from ds_ring.integrations.hf import register_with_transformers

    with pytest.raises(ValueError, match="FuyuConfig is a vision-language model's config.*pass the model"):
        register_with_transformers(vlm_zoo.tiny_config("fuyu"), config={"ring_attention": {"strategy": "ring"}})


def test_a_text_model_built_of_sub_models_stays_a_text_model():
    from ds_ring.integrations.hf.vision import cut_point, towers

    blt = _meta("blt")
    assert towers(blt)  # its byte encoder, global transformer and decoder have configs of their own
    assert cut_point(blt) is None


def test_a_tower_feeding_a_decoder_built_from_the_model_s_own_config_is_refused_before_the_probe():
    from ds_ring.integrations.hf import register_with_transformers

    model = vlm_zoo.build("chameleon", attention="sdpa")
    with pytest.raises(ValueError, match=r"ChameleonForConditionalGeneration has a tower \(model.vqmodel, built from "
                                         r"ChameleonVQVAEConfig\) and no language model of its own"):  # fmt: skip
        register_with_transformers(model, config={"ring_attention": {"strategy": "ring"}})  # before any exchange


@pytest.mark.parametrize(
    ("family", "refusal"),
    [
        ("evolla", r"EvollaForProteinText2Text's language model \(model\) cross-attends to the image features"),
        ("pi0", r"PI0ForConditionalGeneration has a vision or audio tower, and ds_ring finds no language model"),
        ("git", r"GitForCausalLM has a vision or audio tower, and ds_ring finds no language model"),
    ],
)
def test_a_multimodal_model_without_a_language_model_to_cut_before_is_refused(family, refusal):
    from ds_ring.integrations.hf.vision import cut_point

    with pytest.raises(ValueError, match=refusal):
        cut_point(_meta(family))


def test_every_encoder_decoder_is_refused_with_or_without_a_nested_encoder_config():
    from transformers import UdopConfig

    from ds_ring.integrations.hf.vision import refuse_encoder_decoder

    with pytest.raises(ValueError, match=r"UdopConfig is an encoder-decoder model \(is_encoder_decoder\): its decoder"):
        refuse_encoder_decoder(UdopConfig())


@pytest.mark.slow  # 3 families × 3 strategies on 2 ranks: ~3 min at a load of 10
@pytest.mark.timeout(1800)
def test_fuyu_and_granite4_vision_equal_the_whole_model_and_kosmos2_is_refused_at_the_cut():
    outcomes, skipped = vlm_zoo.run(["fuyu", "granite4_vision", "kosmos-2"], list(vlm_zoo.STRATEGIES))
    assert not skipped
    got = {(o.family, o.strategy): o for o in outcomes}
    for strategy in vlm_zoo.STRATEGIES:
        assert got["fuyu", strategy].status == "equal", got["fuyu", strategy]
        assert got["granite4_vision", strategy].status == "equal", got["granite4_vision", strategy]
        kosmos = got["kosmos-2", strategy]
        assert kosmos.status == "refused" and "with image_embeds of shape [4, 8, 64]" in kosmos.detail, kosmos
