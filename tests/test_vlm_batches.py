"""A vision-language batch through shard_batch and the cut before its language model: MRoPE ids, deepstack, refusals.

On 2 ranks (contiguous and zigzag) with tiny Qwen2-VL and Qwen3-VL and images across the shard boundary:
``shard_batch`` keeps ``input_ids`` and the images whole and gives this rank's ``shift_labels``; the language model
is called with this rank's rows of the whole sequence's ``get_rope_index`` ids (the text row added, never an
``arange`` of the shard), of the merged embeddings, and (Qwen3-VL) of ``visual_pos_masks`` with the deepstack rows
that fall in the shard. Refused: packed position ids, ``pad_to_multiple`` on a length that needs it, a
vision-language config given by name (before any communication); an encoder-decoder vision model (Florence-2,
Pix2Struct, T5Gemma 2, a ``VisionEncoderDecoderModel``), config or instance, for its decoder's cross-attention; a
model that decodes a second sequence from ``decoder_input_ids`` (DiffusionGemma's canvas); a language model with
cross-attention layers to the images (Mllama).
"""

from __future__ import annotations

import pytest
import torch

from ds_ring.testing import rank_results, spawn_ranks
from tests import vlm_zoo
from tests.zoo import Float64Throughout


def _ranks(rank: int, world: int) -> dict:
    import transformers

    import ds_ring
    from ds_ring.integrations.hf import register_with_transformers, shard_batch
    from ds_ring.parallel.order import shard_sequence

    transformers.logging.set_verbosity_error()
    seen = {}
    for family in ("qwen2_vl", "qwen3_vl"):
        model = vlm_zoo.build(family, attention="sdpa")
        full = vlm_zoo.batch(family, model)
        inner = model.model
        with torch.no_grad():
            whole_ids, _ = inner.get_rope_index(
                full["input_ids"], image_grid_thw=full["image_grid_thw"], mm_token_type_ids=full["mm_token_type_ids"]
            )
        for layout in ("contiguous", "zigzag"):
            config = {"ring_attention": {"strategy": "ring", "layout": layout, "timeout_s": 60}}
            topology = ds_ring.Topology(*ds_ring.load_config(config).degrees(world))
            session = register_with_transformers(model, config=config, topology=topology)
            calls = []

            def record(_m, _args, kwargs, calls=calls):  # after ds_ring's cut (registered before this hook)
                calls.append({k: v for k, v in kwargs.items() if k != "deepstack_visual_embeds"} | {
                    "deepstack": kwargs.get("deepstack_visual_embeds")})  # fmt: skip

            handle = inner.language_model.register_forward_pre_hook(record, with_kwargs=True)
            try:
                sharded = shard_batch(session, full)
                with torch.no_grad(), Float64Throughout():
                    model(**{k: v for k, v in sharded.items() if k != "shift_labels"})
                shard = lambda x, dim=1, t=topology, o=layout: shard_sequence(x, t, layout=o, dim=dim)  # noqa: E731
                call = calls[-1]
                text = torch.arange(vlm_zoo.SEQ).expand(vlm_zoo.BATCH, -1)
                seen[family, layout] = {
                    "whole input_ids": torch.equal(sharded["input_ids"], full["input_ids"]),
                    "no position_ids": "position_ids" not in sharded,
                    "pixel_values whole": torch.equal(sharded["pixel_values"], full["pixel_values"]),
                    "shift_labels": torch.equal(
                        sharded["shift_labels"],
                        shard(torch.nn.functional.pad(full["labels"][:, 1:], (0, 1), value=-100)),
                    ),
                    "mrope ids": torch.equal(call["position_ids"][1:], shard(whole_ids, 2)),
                    "text row": torch.equal(call["position_ids"][0], shard(text)),
                    "shard rows": call["inputs_embeds"].shape[1] == vlm_zoo.SEQ // world,
                    "not arange": not torch.equal(call["position_ids"][1:], shard(text).expand(3, -1, -1)),
                }
                if family == "qwen3_vl":
                    local = call["visual_pos_masks"]
                    seen[family, layout]["visual_pos_masks"] = torch.equal(
                        local, shard(full["input_ids"] == vlm_zoo.IMAGE)
                    )
                    seen[family, layout]["deepstack rows"] = all(
                        e.shape[0] == int(local.sum()) for e in call["deepstack"]
                    )
                refusals = []
                for bad in (
                    {**full, "position_ids": torch.cat([torch.arange(32), torch.arange(32)]).expand(2, -1)},
                    {**{k: v for k, v in full.items()}, "input_ids": full["input_ids"][:, :-1],
                     "labels": full["labels"][:, :-1]},
                ):  # fmt: skip
                    try:
                        shard_batch(session, bad, pad_to_multiple=True, check_same=False)
                    except ValueError as err:
                        refusals.append(str(err))
                seen[family, layout]["refusals"] = refusals
            finally:
                handle.remove()
                session.close()
    return seen


@pytest.mark.timeout(1200)
def test_vision_language_batches_are_cut_after_the_merge_with_the_whole_sequences_mrope_ids():
    for rank, seen in enumerate(rank_results(spawn_ranks(_ranks, 2, timeout_s=1200))):
        for (family, layout), checks in seen.items():
            refusals = checks.pop("refusals")
            assert all(checks.values()), (rank, family, layout, checks)
            assert len(refusals) == 2, (rank, family, layout, refusals)
            assert "packed documents of a vision-language model are not supported" in refusals[0]
            assert "pad it in the collator" in refusals[1]


def test_a_vision_language_config_by_name_is_refused_before_any_communication():
    from ds_ring.integrations.hf import register_with_transformers

    with pytest.raises(
        ValueError, match="vision-language model's config.*pass the model to register_with_transformers"
    ):
        register_with_transformers(vlm_zoo.tiny_config("qwen2_vl"), config={"ring_attention": {"strategy": "ring"}})


@pytest.mark.parametrize("family", ["florence2", "pix2struct", "t5gemma2", "vision-encoder-decoder"])
def test_an_encoder_decoder_vision_model_config_is_refused_for_its_cross_attention(family):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ds_ring.integrations.hf import register_with_transformers

    with pytest.raises(ValueError, match="is an encoder-decoder model.*cross-attends to the encoder's whole output"):
        register_with_transformers(CONFIG_MAPPING[family](), config={"ring_attention": {"strategy": "ring"}})


def test_an_encoder_decoder_vision_model_instance_is_refused_before_any_communication():
    from transformers import GPT2Config, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    from ds_ring.integrations.hf import register_with_transformers

    encoder = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        image_size=16, patch_size=4)  # fmt: skip
    decoder = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128)
    model = VisionEncoderDecoderModel(VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder))
    with pytest.raises(ValueError, match="VisionEncoderDecoderConfig is an encoder-decoder model"):
        register_with_transformers(model, config={"ring_attention": {"strategy": "ring"}})


def test_a_language_model_that_cross_attends_to_the_images_is_refused():
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    from ds_ring.integrations.hf.vision import vision_language

    with torch.device("meta"):
        model = MllamaForConditionalGeneration(MllamaConfig())
    with pytest.raises(ValueError, match="model.language_model. cross-attends to the image features"):
        vision_language(model, None, "contiguous")


def test_a_model_decoding_a_second_sequence_is_refused_before_any_communication():
    """DiffusionGemma (config not ``is_encoder_decoder``): its decoder denoises a canvas (``decoder_input_ids``)
    against the encoder's KV cache of ``input_ids``, which the cut would leave a shard of; its logits are the
    canvas's."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from ds_ring.integrations.hf import register_with_transformers
    from ds_ring.integrations.hf.vision import refuse_decoder_inputs

    text = {**vlm_zoo.TEXT, "num_hidden_layers": 1, "vocab_size_per_layer_input": vlm_zoo.VOCAB,
            "hidden_size_per_layer_input": 8, "global_head_dim": 16, "num_experts": 2, "top_k_experts": 1,
            "moe_intermediate_size": 16}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=vision))
    with pytest.raises(ValueError, match="DiffusionGemmaForBlockDiffusion's forward takes decoder_input_ids and its "
                       "decoder .DiffusionGemmaDecoderModel. is not its language model"):  # fmt: skip
        register_with_transformers(model, config={"ring_attention": {"strategy": "ring"}})
    with torch.device("meta"):  # BLIP-2 names decoder_input_ids (for a T5) but decodes with its language model
        refuse_decoder_inputs(vlm_zoo.build("blip-2"))
