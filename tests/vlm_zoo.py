"""transformers' vision-language zoo under ds_ring: each family built tiny, one step on images, sequence-parallel.

Every family of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` is either run or listed with the reason. A family with
an input recipe here (:data:`RECIPES`: the tiny vision tower, the special tokens, the image inputs its processor
makes) is built tiny (text: 2 layers, hidden 64, 4 heads / 2 K/V heads, vocab 128; vision: 2 layers, hidden 32),
random weights, float64 throughout (:class:`~tests.zoo.Float64Throughout`), dropout off, and run on a batch of
:data:`BATCH` rows × :data:`SEQ` tokens with two images per row, the second straddling the middle of the row (the
shard boundary of 2 ranks, and a zigzag chunk boundary); the first straddles a zigzag chunk boundary too. The
reference is the whole model on one process with ``eager`` attention, called with the batch as its processor makes
it; ds_ring runs it registered on :func:`shard_batch`'s batch with :func:`causal_lm_loss`. *equal*: the loss and
each parameter's gradient, the vision tower's included, within :data:`~tests.zoo.TOLERANCE` of its own scale.

``python -m tests.vlm_zoo`` runs it on 2 ranks (one spawned world per family) and writes ``docs/vlm_zoo.md``;
``tests/test_vlm_zoo.py`` runs the same code.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tests.zoo import (
    TOLERANCE,
    Float64Throughout,
    Outcome,
    _logits,
    agreed_outcomes,
    main,
    outcomes_against,
    page,
    trained_on_shards,
)

SEQ, BATCH, VOCAB, IMAGES_PER_ROW = 64, 2, 128, 2
IMAGE, VIDEO, START, END = 5, 6, 3, 4
"""Token ids of the image and video placeholders and of the vision start / end markers (text tokens are ≥ 8)."""

TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4 * SEQ, use_cache=False, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, depth=2, embed_dim=32,
    num_heads=2, head_dim=16,
)  # fmt: skip
MROPE = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
"""3-D rotary sections for a head dim of 16 (they sum to 8)."""

STRATEGIES = {
    "ring": {"strategy": "ring"},
    "zigzag": {"strategy": "ring", "layout": "zigzag"},
    "ulysses": {"strategy": "ulysses", "ulysses_degree": 2},
}


def _square(size: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Images ``[n, 3, size, size]``."""
    return lambda n: {"pixel_values": torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(2))}


def _patches(grid: int, channels: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Qwen-style flattened patches of ``n`` images of ``1 × grid × grid`` patches, and their grids."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(n * grid * grid, channels, generator=generator),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * n),
        }

    return make


def _crops(size: int, crops: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """LLaVA-NeXT-style images ``[n, crops, 3, size, size]`` (the base image and its any-resolution crops) and their
    sizes ``[n, 2]``."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        pixels = torch.randn(n, crops, 3, size, size, generator=generator)
        return {"pixel_values": pixels, "image_sizes": torch.tensor([[size, size]] * n)}

    return make


def _merged(images: Callable[[int], dict[str, torch.Tensor]], merge: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """``images`` and VideoLLaMA3's ``image_merge_sizes [n]``: how many patches a side each image's tokens merge."""
    return lambda n: {**images(n), "image_merge_sizes": torch.tensor([merge] * n)}


def _naflex(side: int, patch: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """SigLIP2's native-resolution patches ``[n, side², 3·patch²]`` of ``n`` images of ``side × side`` patches, their
    ``spatial_shapes [n, 2]`` and all-ones ``pixel_attention_mask [n, side²]``."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(n, side * side, 3 * patch * patch, generator=generator),
            "spatial_shapes": torch.tensor([[side, side]] * n),
            "pixel_attention_mask": torch.ones(n, side * side, dtype=torch.long),
        }

    return make


def _per_row(size: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Idefics3-style images ``[rows, images per row, 3, size, size]`` with their all-ones pixel mask."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        pixels = torch.randn(n // IMAGES_PER_ROW, IMAGES_PER_ROW, 3, size, size, generator=generator)
        ones = torch.ones(*pixels.shape[:2], size, size, dtype=torch.bool)
        return {"pixel_values": pixels, "pixel_attention_mask": ones}

    return make


def _positioned(side: int, patch: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Gemma 4's patches ``[n, side², 3·patch²]`` of ``n`` images of ``side × side`` patches and their ``(x, y)``
    positions ``image_position_ids [n, side², 2]``."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        positions = torch.stack([x.flatten(), y.flatten()], dim=-1)
        return {
            "pixel_values": torch.rand(n, side * side, 3 * patch * patch, generator=generator),
            "image_position_ids": positions.expand(n, side * side, 2).clone(),
        }

    return make


def _patch_images(grid: int, patch: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """PaddleOCR-VL's patches ``[n·grid², 3, patch, patch]`` of ``n`` images of ``1 × grid × grid`` patches, and
    their grids."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(n * grid * grid, 3, patch, patch, generator=generator),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * n),
        }

    return make


def _packed(grid: int, patch: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """MiniCPM's NaViT-packed patches of ``n`` images of ``grid × grid`` patches side by side, ``[1, 3, patch,
    n·grid²·patch]``, and their ``target_sizes [n, 2]`` (in patches)."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(1, 3, patch, n * grid * grid * patch, generator=generator),
            "target_sizes": torch.tensor([[grid, grid]] * n),
        }

    return make


def _text(n: int) -> dict[str, torch.Tensor]:
    """No images: a family of the mapping without a vision tower (Mistral 4's causal LM)."""
    return {}


@dataclass(frozen=True)
class Recipe:
    """How to build one family tiny and feed it images: its vision config's fields, its text config's and the
    composite's beyond :data:`TEXT` / :data:`VISION`, the images, and which extra inputs its processor makes."""

    images: Callable[[int], dict[str, torch.Tensor]]
    vision: dict[str, Any] = field(default_factory=dict)
    text: dict[str, Any] = field(default_factory=dict)
    top: dict[str, Any] = field(default_factory=dict)
    mm_token_type_ids: bool = False  # Qwen's processors: 1 at image tokens (MRoPE's groups)
    token_type_ids: str = ""  # "image": 1 at image tokens (Gemma 3); "suffix": 1 after the prefix (PaliGemma)
    image_sizes: int = 0  # Pixtral's image_sizes [n, 2] of this side
    init: dict[str, Any] = field(default_factory=dict)  # the config's constructor's arguments; a text_config here
    # is the whole text config (Gemma 4's per-layer head_dim is set at construction only)
    whole_model_fails: str = ""  # why transformers' own whole model fails on this family: listed while it does


_QFORMER = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                encoder_hidden_size=32, vocab_size=VOCAB)  # fmt: skip
"""BLIP-2's querying transformer, tiny."""
_QWEN = dict(patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=64)
RECIPES: dict[str, Recipe] = {
    "qianfan_ocr": Recipe(_square(32), {"image_size": [32, 32], "patch_size": [4, 4]}, top={"downsample_ratio": 0.5}),
    "qwen2_vl": Recipe(_patches(8, 24), {**_QWEN, "hidden_size": 64, "mlp_ratio": 2}, {"rope_parameters": MROPE},
                       mm_token_type_ids=True),
    "qwen2_5_vl": Recipe(_patches(8, 24), {**_QWEN, "window_size": 8, "fullatt_block_indexes": [1]},
                         {"rope_parameters": MROPE}, mm_token_type_ids=True),
    "qwen3_vl": Recipe(_patches(8, 24), {**_QWEN, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
                       {"rope_parameters": {**MROPE, "mrope_interleaved": True}}, mm_token_type_ids=True),
    "qwen3_vl_moe": Recipe(_patches(8, 24), {**_QWEN, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
                           {"rope_parameters": {**MROPE, "mrope_interleaved": True}, "num_experts": 4,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
                           mm_token_type_ids=True),
    "qwen3_5": Recipe(_patches(8, 24), {**_QWEN, "num_position_embeddings": 16},
                      {"rope_parameters": {**MROPE, "mrope_interleaved": True},
                       "layer_types": ["linear_attention", "full_attention"]}, mm_token_type_ids=True),
    "qwen3_5_moe": Recipe(_patches(8, 24), {**_QWEN, "num_position_embeddings": 16},
                          {"rope_parameters": {**MROPE, "mrope_interleaved": True},
                           "layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                           "shared_expert_intermediate_size": 32}, mm_token_type_ids=True),
    "glm_ocr": Recipe(_patches(8, 24), {**_QWEN, "image_size": 16}, {"rope_parameters": MROPE},
                      top={"image_start_token_id": START, "image_end_token_id": END}, mm_token_type_ids=True),
    "glm4v": Recipe(_patches(8, 24), {**_QWEN, "image_size": 16}, {"rope_parameters": MROPE},
                    top={"image_start_token_id": START, "image_end_token_id": END}, mm_token_type_ids=True),
    "glm46v": Recipe(_patches(8, 24), {**_QWEN, "image_size": 16}, {"rope_parameters": MROPE},
                     top={"image_start_token_id": START, "image_end_token_id": END}, mm_token_type_ids=True),
    "aria": Recipe(_square(32), {"image_size": 32, "patch_size": 4},
                   {"moe_num_experts": 4, "moe_topk": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1},
                   top={"projector_patch_to_query_dict": {64: 8}, "max_value_projector_patch_to_query_dict": 8}),
    "aya_vision": Recipe(_square(32), {"image_size": 32, "patch_size": 4}, top={"downsample_factor": 2}),
    "blip-2": Recipe(_square(16), {"image_size": 16, "patch_size": 4}, {"word_embed_proj_dim": 64, "ffn_dim": 128},
                     top={"num_query_tokens": 8, "qformer_config": _QFORMER}),
    "cohere2_vision": Recipe(_square(32), {"image_size": 32, "patch_size": 4}, top={"downsample_factor": 2}),
    "got_ocr2": Recipe(_square(32), {"image_size": 32, "patch_size": 4}),
    "internvl": Recipe(_square(32), {"image_size": [32, 32], "patch_size": [4, 4]}, top={"downsample_ratio": 0.5}),
    "janus": Recipe(_square(16), {"image_size": 16, "patch_size": 4, "projection_dim": 64, "depth": 1},
                    top={"vq_config": {"base_channels": 32, "channel_multiplier": [1, 1], "latent_channels": 32,
                                       "num_embeddings": 16, "embed_dim": 8, "image_token_embed_dim": 64,
                                       "projection_dim": 64, "num_res_blocks": 1, "num_patches": 4}}),
    "lfm2_vl": Recipe(_naflex(4, 4), {"patch_size": 4, "num_patches": 16},
                      {"layer_types": ["conv", "full_attention"]}, top={"projector_hidden_size": 64}),
    "lfm3_vl": Recipe(_patches(8, 24), {**_QWEN, "num_key_value_heads": 1}, {"layer_types": ["conv", "full_attention"]},
                      top={"projector_hidden_size": 64}),
    "lighton_ocr": Recipe(_square(32), {"image_size": 32, "patch_size": 4}, top={"spatial_merge_size": 2},
                          image_sizes=32),
    "llava": Recipe(_square(16), {"image_size": 16, "patch_size": 4, "projection_dim": 32}),
    "llava_next": Recipe(_crops(8, 2), {"image_size": 8, "patch_size": 4, "projection_dim": 32},
                         top={"image_grid_pinpoints": [[8, 8]]}),
    "llava_next_video": Recipe(_crops(8, 2), {"image_size": 8, "patch_size": 4, "projection_dim": 32},
                               top={"image_grid_pinpoints": [[8, 8]]}),
    "llava_onevision": Recipe(_crops(8, 2), {"image_size": 8, "patch_size": 4},
                              top={"image_grid_pinpoints": [[8, 8]]}),
    "video_llama_3": Recipe(_merged(_patches(8, 12), 2), {"patch_size": 2}),
    "vipllava": Recipe(_square(16), {"image_size": 16, "patch_size": 4, "projection_dim": 32},
                       top={"vision_feature_layers": [-2, -1]}),
    "video_llava": Recipe(lambda n: {"pixel_values_images": _square(16)(n)["pixel_values"]},
                          {"image_size": 16, "patch_size": 4, "projection_dim": 32}),
    "mistral3": Recipe(_square(32), {"image_size": 32, "patch_size": 4}, top={"spatial_merge_size": 2},
                       image_sizes=32),
    "idefics2": Recipe(_per_row(32), {"image_size": 32, "patch_size": 4},
                       top={"perceiver_config": {"hidden_size": 64, "resampler_n_latents": 8, "resampler_depth": 1,
                                                 "resampler_n_heads": 2, "resampler_head_dim": 16,
                                                 "num_key_value_heads": 1}}),
    "idefics3": Recipe(_per_row(32), {"image_size": 32, "patch_size": 4}, top={"scale_factor": 2}),
    "smolvlm": Recipe(_per_row(32), {"image_size": 32, "patch_size": 4}, top={"scale_factor": 2}),
    "deepseek_vl": Recipe(_square(16), {"image_size": 16, "patch_size": 4}),
    "gemma3": Recipe(_square(32), {"image_size": 32, "patch_size": 4}, top={"mm_tokens_per_image": 16},
                     token_type_ids="image"),
    "paligemma": Recipe(_square(16), {"image_size": 16, "patch_size": 4, "projection_dim": 64},
                        {"hidden_size": 64}, top={"projection_dim": 64}, token_type_ids="suffix"),
}  # fmt: skip
"""Families run here, and how."""

RECIPES.update({  # group a
})  # fmt: skip

_GEMMA4_TEXT = dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, sliding_window=16,
                    use_bidirectional_attention="vision", global_head_dim=16)  # fmt: skip
"""Gemma 4's text model tiny: its per-layer embeddings, a sliding window shorter than the row, bidirectional images."""
_GEMMA4_LARGE = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
                     num_kv_shared_layers=1, attention_k_eq_v=True, num_global_key_value_heads=1,
                     enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)  # fmt: skip
"""What its larger checkpoints add: MoE, keys as values with one K/V head in global layers, a KV-shared last layer."""
_YARN_LLAMA4 = {"type": "yarn", "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 16.0,
                "original_max_position_embeddings": 16, "max_position_embeddings": 4 * SEQ, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}  # fmt: skip
"""Mistral 4's YaRN with its Llama-4 query scaling by position, which steps every 16 tokens here."""
_GEMMA3N_TEXT = dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, sliding_window=16,
                     num_hidden_layers=3, num_kv_shared_layers=1, laurel_rank=8, activation_sparsity_pattern=[0.0] * 3,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])  # fmt: skip
"""Gemma 3n's text model tiny: its per-layer inputs, a third layer sharing the first's keys and values."""
RECIPES.update({  # group b
    "gemma4": Recipe(_positioned(6, 4), {"patch_size": 4, "pooling_kernel_size": 2, "position_embedding_size": 16,
                                         "num_key_value_heads": 2},
                     init={"vision_config": {}, "text_config": {**TEXT, **_GEMMA4_TEXT, **_GEMMA4_LARGE}},
                     mm_token_type_ids=True),
    "gemma4_unified": Recipe(_positioned(3, 4), {"patch_size": 2, "pooling_kernel_size": 2, "mm_embed_dim": 32,
                                                 "output_proj_dims": 32, "mm_posemb_size": 16},
                             init={"vision_config": {}, "text_config": {**TEXT, **_GEMMA4_TEXT}},
                             mm_token_type_ids=True),
    "mistral4": Recipe(_text, init={**TEXT, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 32,
                                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "rope_parameters": _YARN_LLAMA4}),
    "mistral_large4": Recipe(_square(32), {"image_size": 32, "patch_size": 4}, top={"spatial_merge_size": 2},
                             image_sizes=32,
                             init={"text_config": {**TEXT, "num_key_value_heads": 4, "kv_lora_rank": 16,
                                                   "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                                                   "n_routed_experts": 4, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 32, "index_topk": 16,
                                                   "index_head_dim": 16, "index_n_heads": 2,
                                                   "no_rope_layer_interval": 2}}),
    "ovis2": Recipe(_square(16), {"image_size": 16, "patch_size": 4, "vocab_size": 32},
                    top={"hidden_size": 64, "vocab_size": VOCAB, "visual_indicator_token_ids": (START, END, 7, 1, 2)}),
    "paddleocr_vl": Recipe(_patch_images(8, 4), {"image_size": 16, "patch_size": 4, "spatial_merge_size": 2},
                           {"rope_parameters": MROPE}, mm_token_type_ids=True),
    "pp_chart2table": Recipe(_square(32), {"image_size": 32, "patch_size": 4, "mlp_dim": 64}),  # GOT-OCR2's model
    "unlimited_ocr": Recipe(_square(32), {"sam_config": {**VISION, "output_channels": 16, "image_size": 32,
                                                         "patch_size": 4, "window_size": 4, "global_attn_indexes": (1,),
                                                         "mlp_dim": 64, "downsample_channels": (32, 32)},
                                          "encoder_config": {**VISION, "image_size": 28, "patch_size": 14}},
                            init={"text_config": {**TEXT, "num_key_value_heads": 4, "n_routed_experts": 4,
                                                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                  "n_shared_experts": 1, "sliding_window": 16}}),
    "minicpm_ocr": Recipe(_packed(8, 4), {"image_size": 32, "patch_size": 4},
                          {"rope_parameters": {**MROPE, "mrope_interleaved": True},
                           "layer_types": ["linear_attention", "full_attention"]}),
    "fast_vlm": Recipe(_square(128), {"hidden_size": 64, "model_args": {  # FastViT-HD through timm, 4 tokens
        "inference_mode": True, "layers": (1, 1, 1, 1, 1), "embed_dims": (8, 16, 16, 32, 32)}}),
    "perception_lm": Recipe(lambda n: {"pixel_values": _square(32)(n)["pixel_values"][:, None]},  # 1 tile each
                            {"architecture": "vit_pe_core_tiny_patch16_384", "model_args": {
                                "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 32, "patch_size": 8,
                                "ref_feat_shape": (4, 4), "global_pool": ""}}),
    "gemma3n": Recipe(_square(64), {"hidden_size": 2048, "vocab_offset": VOCAB, "model_args": {  # MobileNetV5 (timm)
        "channel_multiplier": 0.05, "msfa_output_resolution": 4}},  # its fusion adapter's 2048 channels are fixed
                      init={"text_config": {**TEXT, **_GEMMA3N_TEXT},
                            "audio_config": {"hidden_size": 32, "vocab_offset": VOCAB + 128,
                                             "conf_num_hidden_layers": 1, "conf_num_attention_heads": 2,
                                             "sscp_conv_channel_size": (8, 8)}},
                      top={"vision_soft_tokens_per_image": 16}),
    "diffusion_gemma": Recipe(_positioned(6, 4), {"patch_size": 4, "pooling_kernel_size": 2,  # refused: listed
                                                  "position_embedding_size": 16, "num_key_value_heads": 2},
                              init={"text_config": {**TEXT, **_GEMMA4_TEXT, "num_experts": 4, "top_k_experts": 2,
                                                    "moe_intermediate_size": 32}}),
    "llama4": Recipe(_square(16), {"image_size": 16, "patch_size": 4, "intermediate_size": 128,
                                   "vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32},
                     init={"text_config": {**TEXT, "num_local_experts": 4, "intermediate_size_mlp": 128,
                                           "no_rope_layer_interval": 2, "attention_chunk_size": 16,
                                           "floor_scale": 8}},
                     whole_model_fails="transformers 5.24's Llama4ForConditionalGeneration.forward reads "
                     "image_outputs from its language model's MoeCausalLMOutputWithPast, which has none (with "
                     "return_dict=False its output decorator calls to_tuple() on the tuple it returns)"),
})  # fmt: skip

RECIPES.update({  # group c
})  # fmt: skip

RECIPES.update({  # group d
})  # fmt: skip

EXPECTED_REFUSALS: dict[str, str] = {
    "got_ocr2": r"does not match the model's config._attn_implementation 'eager'",  # its SAM encoder has no sdpa
}
"""Family → the refusal it gets (Gemma 3's image spans and PaliGemma's prefix are computed: issue 45)."""

EXPECTED_REFUSALS.update({  # group a
})  # fmt: skip

EXPECTED_REFUSALS.update({  # group b
    # its DeepSeek sparse attention: an indexer picks each query's top-k keys into the mask, as DeepSeek-V3.2's
    "mistral_large4": r"uses its attention mask as a tensor .* train this model without sequence parallelism",
    "pp_chart2table": r"does not match the model's config._attn_implementation 'eager'",  # GOT-OCR2's SAM: no sdpa
    # its "reference" sliding window: the window OR'd with the prefill (all of it, in training: causal)
    "unlimited_ocr": r"UnlimitedOcrTextAttention is given a mask with an OR of masks .*create_reference_sliding_window",
})  # fmt: skip

EXPECTED_REFUSALS.update({  # group c
})  # fmt: skip

EXPECTED_REFUSALS.update({  # group d
})  # fmt: skip


def families() -> list[str]:
    """Every family of transformers' image-text-to-text mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _set(config: Any, values: dict[str, Any]) -> None:
    """Set the fields of ``values`` that ``config`` has; a dict into a nested config (Idefics2's perceiver) sets its
    fields."""
    for key, value in values.items():
        nested = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(nested, "to_dict"):
            _set(nested, value)
        elif hasattr(config, key):
            with contextlib.suppress(AttributeError, NotImplementedError):
                setattr(config, key, value)


def tiny_config(family: str) -> Any:
    """The family's default config with :data:`TEXT`, :data:`VISION` and the recipe's fields, dropout off (in its
    nested configs too), the placeholder ids :data:`IMAGE` / :data:`VIDEO` / :data:`START` / :data:`END`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    recipe = RECIPES[family]
    config = CONFIG_MAPPING[family](**recipe.init)
    if "text_config" not in recipe.init and hasattr(config, "text_config"):  # else: the recipe's init made it
        _set(config.text_config, {**TEXT, **recipe.text})
    _set(getattr(config, "vision_config", None), {**VISION, **recipe.vision})
    ids = dict(image_token_id=IMAGE, image_token_index=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
               vision_end_token_id=END, boi_token_index=START, eoi_token_index=END, pad_token_id=0)  # fmt: skip
    _set(config, {**ids, **recipe.top})
    _no_dropout(config)
    return config


def _no_dropout(config: Any) -> None:
    """Every ``*drop*`` probability of ``config`` and of the configs nested in it set to 0: dropout (BLIP-2's Q-Former
    passes its attention dropout to the attention function, no ``nn.Dropout`` to switch off) and stochastic depth
    (Qianfan-OCR's vision ``drop_path_rate``)."""
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and "drop" in key:  # dropout, and stochastic depth (drop_path_rate)
            setattr(config, key, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _no_dropout(value)


def build(family: str, attention: str = "eager") -> torch.nn.Module:
    """The tiny float64 model of ``family`` (seeded: the same weights on every rank), in training mode."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    config = tiny_config(family)
    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    torch.manual_seed(0)
    model = cls._from_config(
        config, dtype=torch.float64, attn_implementation=attention, experts_implementation="eager"
    ).double()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def image_tokens(model: torch.nn.Module, images: dict[str, torch.Tensor]) -> int:
    """How many placeholder tokens each image takes: the rows the model's own image features have, per image."""
    inner = getattr(model, "model", model)
    features = inner.get_image_features(**images, return_dict=True)
    pooled = getattr(features, "pooler_output", features)
    if pooled is None:  # Llama 4: its projector runs in the model's forward, on the vision model's last hidden state
        pooled = features.last_hidden_state
    parts = pooled if isinstance(pooled, list | tuple) else [pooled]
    rows = sum(part.reshape(-1, part.shape[-1]).shape[0] for part in parts)
    return rows // (BATCH * IMAGES_PER_ROW)


def batch(family: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full batch as the family's processor makes it: ``input_ids [BATCH, SEQ]`` with two images per row, the
    first at token 4 (across SEQ/4, a zigzag chunk boundary of 2 ranks), the second across SEQ/2; labels -100 at
    the image tokens; the images and the family's extra inputs."""
    recipe = RECIPES[family]
    images = recipe.images(BATCH * IMAGES_PER_ROW)
    if recipe.image_sizes:
        images["image_sizes"] = torch.tensor([[recipe.image_sizes] * 2] * (BATCH * IMAGES_PER_ROW))
    tokens = 0  # a text-only family of the mapping (Mistral 4): rows of text
    if images:
        with torch.no_grad(), Float64Throughout():
            tokens = image_tokens(model, {k: v.double() if v.is_floating_point() else v for k, v in images.items()})
    starts = [4, SEQ // 2 - tokens // 2]
    if images and (tokens == 0 or starts[0] + tokens >= starts[1] - 1):
        raise ValueError(f"{tokens} tokens per image do not fit twice in {SEQ}")
    input_ids = torch.randint(8, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    is_image = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    for start in starts if images else []:
        input_ids[:, start - 1], input_ids[:, start + tokens] = START, END
        is_image[:, start : start + tokens] = True
    input_ids[is_image] = IMAGE
    labels = input_ids.masked_fill(is_image, -100)
    full = {"input_ids": input_ids, "labels": labels, **images}
    if recipe.mm_token_type_ids:
        full["mm_token_type_ids"] = is_image.long()
    if recipe.token_type_ids == "image":
        full["token_type_ids"] = is_image.long()
    elif recipe.token_type_ids == "suffix":
        full["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2 + tokens).long().expand(BATCH, SEQ).clone()
    return {k: v.double() if v.is_floating_point() else v for k, v in full.items()}


def _inputs(full: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in full.items() if k != "labels"}


def reference(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole model on the whole batch: the token-mean loss and every parameter's gradient."""
    model.zero_grad()
    logits = _logits(model(**_inputs(full)))
    shifted = F.pad(full["labels"], (0, 1), value=-100)[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1).double(), shifted.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }


def sequence_parallel(
    model: torch.nn.Module,
    full: dict[str, torch.Tensor],
    section: dict[str, Any],
    topology: Any,
    divide_vision: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registered model on :func:`shard_batch`'s batch: the loss and every gradient summed over the group."""
    from ds_ring.integrations.hf import register_with_transformers

    model.set_attn_implementation("sdpa")
    config = {"train_micro_batch_size_per_gpu": BATCH, "ring_attention": {"timeout_s": 60, **section}}
    session = register_with_transformers(model, config=config, topology=topology, divide_vision=divide_vision)
    return trained_on_shards(model, session, full, topology)


def check(family: str, strategies: list[str], topologies: dict[str, Any]) -> list[Outcome]:
    """One family under each of ``strategies`` on this rank (every rank calls it alike)."""
    model = build(family)
    full = batch(family, model)
    try:
        with Float64Throughout():
            loss, grads = reference(model, full)
        missing = None
    except Exception as err:  # noqa: BLE001 - no reference: listed, after ds_ring had its say
        loss = grads = None
        missing = f"{type(err).__name__}: {str(err)[:100]}"

    def step(strategy: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return sequence_parallel(model, full, STRATEGIES[strategy], topologies[strategy])

    return outcomes_against(family, strategies, step, (loss, grads, missing))


def run_family(rank: int, world: int, family: str, strategies: list[str]) -> list[Outcome]:
    """Rank function: one family under every strategy (ranks agree on each outcome)."""
    return agreed_outcomes(world, [family], strategies, STRATEGIES, check)


def refused_config(family: str) -> str:
    """``"refused: <why>"`` when ``register_with_transformers`` refuses the family from its default config alone,
    whatever its inputs: an encoder-decoder vision model
    (:func:`~ds_ring.integrations.hf.vision.refuse_encoder_decoder`, the check registration makes first), or a
    language model that cross-attends to the images
    (:func:`~ds_ring.integrations.hf.vision.refuse_cross_attention` on the model built on the meta device); ``""``
    otherwise."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from ds_ring.integrations.hf.vision import find_language_model, refuse_cross_attention, refuse_encoder_decoder

    config = CONFIG_MAPPING[family]()
    try:
        refuse_encoder_decoder(config)
    except ValueError as err:
        return f"refused: {err}"
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]._from_config(config)
    except Exception:  # noqa: BLE001 - a default config that does not build: no recipe, as before
        return ""
    found = find_language_model(model)
    try:
        if found is not None:
            refuse_cross_attention(type(model).__name__, *found)
    except ValueError as err:
        return f"refused: {err}"
    return ""


def not_run(names: list[str]) -> dict[str, str]:
    """Family → why it is not run here: ds_ring refuses its config (:func:`refused_config`), no recipe, a tiny
    build that fails, ds_ring refusing the tiny instance whatever its inputs
    (:func:`~ds_ring.integrations.hf.vision.refuse_decoder_inputs`), or transformers' own whole model failing as its
    recipe's ``whole_model_fails`` says."""
    from ds_ring.integrations.hf.vision import refuse_decoder_inputs

    why = {}
    for family in names:
        if family not in RECIPES:
            refusal = refused_config(family)
            why[family] = refusal or "no input recipe in tests/vlm_zoo.py yet (its tiny vision tower and image inputs)"
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = build(family)
        except Exception as err:  # noqa: BLE001 - every reason is listed
            first = next((line for line in str(err).splitlines() if line.strip()), "")  # transformers' start "\n"
            why[family] = f"{type(err).__name__}: {first[:160]}"
            continue
        try:  # refused at registration from the instance, whatever its inputs (DiffusionGemma's second sequence)
            refuse_decoder_inputs(model)
        except ValueError as err:
            why[family] = f"refused: {err}"
            continue
        failure = RECIPES[family].whole_model_fails
        if failure:  # checked, not trusted: once transformers' model runs, the family runs here
            try:
                with torch.no_grad(), Float64Throughout():
                    model(**_inputs(batch(family, model)))
            except Exception as err:  # noqa: BLE001 - the failure it has
                why[family] = f"no reference: {failure} ({type(err).__name__}: {str(err).splitlines()[0][:100]})"
    return why


def run(names: list[str], strategies: list[str]) -> tuple[list[Outcome], dict[str, str]]:
    """Every family of ``names`` that has a recipe and builds, each in its own world of 2 ranks; why not the rest."""
    from ds_ring.testing import rank_results, spawn_ranks

    skipped = not_run(names)
    outcomes = []
    for family in names:
        if family in skipped:
            continue
        kwargs = {"family": family, "strategies": strategies}
        outcomes += rank_results(spawn_ranks(run_family, 2, timeout_s=1800, kwargs=kwargs))[0]
    return outcomes, skipped


def table(outcomes: list[Outcome], skipped: dict[str, str], seconds: float) -> str:
    """The docs page: totals per strategy, one row per family run, then the families listed and why."""
    about = f"""\
Generated by `python -m tests.vlm_zoo`; `pytest -m zoo tests/test_vlm_zoo.py` runs the same code and fails
when this page differs from its run (the run-time line aside); do not edit by hand. Each family of
transformers' `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` with an input recipe in `tests/vlm_zoo.py` is
built tiny (text: 2 layers, hidden 64, 4 heads / 2 K/V heads, vocab {VOCAB}; vision: 2 layers, hidden 32),
random weights, float64 throughout; {BATCH} rows × {SEQ} tokens with {IMAGES_PER_ROW} images per row, one
across the middle of the row (the shard boundary of 2 ranks) and one across a zigzag chunk boundary, on 2
ranks. *equal*: the loss and each parameter's gradient (summed over the ranks; the vision tower's included)
equal the whole model's with `eager` attention to {TOLERANCE:g} relative to that parameter's own largest
gradient; the last column names the worst parameter and its error, rounded up to a power of ten."""
    title = "transformers' vision-language zoo under ds_ring"
    return page(title, about, outcomes, f"Not run here ({len(skipped)})", skipped, seconds)


if __name__ == "__main__":
    main(out="docs/vlm_zoo.md", zoo=run, every=families, strategies=STRATEGIES, page=table, description=__doc__)
