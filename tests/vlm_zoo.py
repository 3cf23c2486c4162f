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


def _flat_patches(patches: int, size: int, key: str = "image_patches") -> Callable[[int], dict[str, torch.Tensor]]:
    """Fuyu-style flattened patches of ``n`` images of ``patches`` patches each, ``[n · patches, 3·size²]``, under
    ``key`` (Fuyu's processor still names them ``image_patches``, which its model takes as ``pixel_values``)."""
    return lambda n: {key: torch.randn(n * patches, 3 * size * size, generator=torch.Generator().manual_seed(2))}


Images = Callable[[int], dict[str, torch.Tensor]]
"""What a recipe's images are: ``n`` → the image inputs of ``n`` images."""


def _prompted(images: Images, length: int) -> Images:
    """``images`` and InstructBLIP's Q-Former prompt per image: ``qformer_input_ids [n, length]`` (text ids ≥ 8) and
    its all-ones ``qformer_attention_mask``."""

    def make(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(8, VOCAB, (n, length), generator=torch.Generator().manual_seed(3))
        return {**images(n), "qformer_input_ids": ids, "qformer_attention_mask": torch.ones_like(ids)}

    return make


def _frames(size: int, frames: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Videos ``[n, frames, 3, size, size]``."""
    return lambda n: {"pixel_values": torch.randn(n, frames, 3, size, size, generator=torch.Generator().manual_seed(2))}


def _tiles(size: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Granite-Docling-style tiles ``[rows, images per row, 3, size, size]`` with their all-true tile mask
    ``pixel_attention_mask [rows, images per row]``."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        pixels = torch.randn(n // IMAGES_PER_ROW, IMAGES_PER_ROW, 3, size, size, generator=generator)
        return {"pixel_values": pixels, "pixel_attention_mask": torch.ones(*pixels.shape[:2], dtype=torch.bool)}

    return make


def _flattened(side: int, patch: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Pix2Struct-style ``flattened_patches [n, side², 2 + 3·patch²]`` of ``n`` images of ``side × side`` patches: each
    patch's row and column, then its pixels."""

    def make(n: int) -> dict[str, torch.Tensor]:
        pixels = torch.randn(n, side * side, 3 * patch * patch, generator=torch.Generator().manual_seed(2))
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        where = torch.stack([rows.flatten(), cols.flatten()], dim=-1).to(pixels.dtype).expand(n, -1, -1)
        return {"flattened_patches": torch.cat([where, pixels], dim=-1)}

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
    """Kimi-K2.5's and PaddleOCR-VL's patches ``[n·grid², 3, patch, patch]`` of ``n`` images of ``1 × grid × grid``
    patches, and their grids."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(n * grid * grid, 3, patch, patch, generator=generator),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * n),
        }

    return make


def _low_and_high(low: int, high: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """DeepSeek-VL-Hybrid's images ``[n, 3, low, low]`` and the same images at ``[n, 3, high, high]`` for its SAM
    encoder (``high_res_pixel_values``)."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(n, 3, low, low, generator=generator),
            "high_res_pixel_values": torch.randn(n, 3, high, high, generator=generator),
        }

    return make


def _pooled_crops(patches: int, width: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Molmo2-style crops ``[n, patches, width]`` (one crop per image), the patches each of an image's 8 tokens pools
    (``image_token_pooling [8n, 4]``: 4 tokens of 4 patches, 4 of 2 patches and 2 padding slots, ``-1``) and their
    grids ``[n, 4]`` (2 × 2 pooled tokens, twice)."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        pooling = []
        for image in range(n):
            first = image * patches
            pooling += [[first + 4 * t + k for k in range(4)] for t in range(4)]
            pooling += [[first + 2 * t, first + patches - 1 - t, -1, -1] for t in range(4)]
        return {
            "pixel_values": torch.randn(n, patches, width, generator=generator),
            "image_token_pooling": torch.tensor(pooling),
            "image_grids": torch.tensor([[2, 2, 2, 2]] * n),
        }

    return make


def _packed(grid: int, patch: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """MiniCPM-V's NaViT-packed patches of ``n`` images of ``grid × grid`` patches in one row
    ``[1, 3, patch, n·grid²·patch]``, and their ``target_sizes [n, 2]`` in patches."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(1, 3, patch, n * grid * grid * patch, generator=generator),
            "target_sizes": torch.tensor([[grid, grid]] * n),
        }

    return make


def _patches_hw(grid: int, channels: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """RADIO's flattened patches ``[n·grid², channels]`` of ``n`` images of ``grid × grid`` patches, and their
    ``image_grid_hw [n, 2]``."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(n * grid * grid, channels, generator=generator),
            "image_grid_hw": torch.tensor([[grid, grid]] * n),
        }

    return make


def _merged_patches(grid: int, side: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Inkling 2's pixels ``[n·grid², side, side, 3]`` (one ``side × side`` block of merged patches per image token) of
    ``n`` images of ``grid × grid`` tokens, and their ``image_grid_thw [n, 3]`` in tokens."""

    def make(n: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(2)
        return {
            "pixel_values": torch.randn(n * grid * grid, side, side, 3, generator=generator),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * n),
        }

    return make


def _tubelets(temporal: int, patch: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """Inkling's patches ``[n·16, temporal, patch, patch, 3]`` of ``n`` images of 16 patches (one token each)."""
    return lambda n: {
        "pixel_values": torch.randn(n * 16, temporal, patch, patch, 3, generator=torch.Generator().manual_seed(2))
    }


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
    moe_mm_token_type_ids: bool = False  # ERNIE 4.5-VL's: 1 at image tokens and their start / end (its experts)
    token_type_ids: str = ""  # "image": 1 at image tokens (Gemma 3); "suffix": 1 after the prefix (PaliGemma)
    image_sizes: int = 0  # Pixtral's image_sizes [n, 2] of this side
    tokens_per_image: int = 0  # placeholder tokens per image when the model's image features cannot be asked (Fuyu)
    features: str = "get_image_features"  # the method giving the image features (InstructBLIP-Video: its videos')
    placeholder: int = IMAGE  # the token id the images' features replace (InstructBLIP-Video: VIDEO)
    image_mask: str = ""  # the input that is 1 at the image tokens, if any (Kosmos-2: image_embeds_position_mask)
    seq: int = SEQ  # tokens per row: more where two images of the family's fixed token count do not fit in SEQ
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

_VQ = dict(base_channels=32, channel_multiplier=[1, 1, 1], num_res_blocks=1, attn_resolutions=[], latent_channels=8)
"""A VQ-VAE that downsamples 4 times a side, tiny."""


_AUDIO = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
              output_dim=64, max_source_positions=64, n_window=8)  # fmt: skip
"""The Qwen omni thinkers' audio tower, tiny."""

_DOTS3_TEXT = dict(head_dim=32, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                   qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, n_shared_experts=1, shared_experts_intermediate_size=32, index_topk=16,
                   index_head_dim=16, index_n_heads=2, use_sliding_window=False)  # fmt: skip
_DOTS3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=2,
                     adapter_in_dim=32, adapter_out_dim=64, moe_intermediate_size=32,
                     pyramid_num_routed=[-1, 4])  # fmt: skip
"""Dots3 Note's text and vision configs, tiny, at construction (its per-layer MLA and expert configs derive there)."""

RECIPES.update({  # group a
    "kosmos-2": Recipe(_square(16), {"image_size": 16, "patch_size": 4},
                       {"embed_dim": 64, "layers": 2, "ffn_dim": 128, "attention_heads": 4},
                       top={"latent_query_num": 8}, image_mask="image_embeds_position_mask"),
    "kosmos-2.5": Recipe(_flattened(4, 4), {"patch_embed_hidden_size": 48, "max_num_patches": 16},
                         {"embed_dim": 64, "layers": 2, "ffn_dim": 128, "attention_heads": 4},
                         top={"latent_query_num": 8}, image_mask="image_embeds_position_mask"),
    "granite4_vision": Recipe(_crops(8, 2), {"image_size": 8, "patch_size": 4, "hidden_size": 64},
                              top={"image_grid_pinpoints": [[8, 8]], "downsample_rate": "1/2",
                                   "deepstack_layer_map": [[0, 0]], "spatial_target_layers": [1, 1, 1, 1],
                                   "vision_feature_layer": -1,
                                   "qformer_config": {"hidden_size": 64, "num_attention_heads": 1,
                                                      "encoder_hidden_size": 64, "intermediate_size": 64}},
                              tokens_per_image=3),  # its features: deepstack layers only
    "chameleon": Recipe(_square(16), text={"vocab_size": VOCAB + 8}, top={  # image codes past the labels' ids: their
        "vq_config": {**_VQ, "embed_dim": 8, "num_embeddings": 8, "resolution": 16},  # logits are masked to -inf
        "vocabulary_map": {"<image>": IMAGE, **{f"IMGIMG{chr(ord('A') + i)}Z": VOCAB + i for i in range(8)}}}),
    "emu3": Recipe(_square(8), top={
        "vq_config": {**_VQ, "embed_dim": 4, "latent_channels": 4, "codebook_size": 16, "hidden_size": 32},
        "vocabulary_map": {"<image>": IMAGE, "<|extra_200|>": 7,
                           **{f"<|visual token{i:06d}|>": 100 + i for i in range(16)}}}, image_sizes=8),
    "fuyu": Recipe(_flat_patches(8, 4), top={"patch_size": 4, "num_channels": 3}, tokens_per_image=8),
    "shieldgemma2": Recipe(_square(32), {"image_size": 32, "patch_size": 4}, top={"mm_tokens_per_image": 16},
                           token_type_ids="image"),
    "granite_docling": Recipe(_tiles(32), {"image_size": 32, "patch_size": 4, "scale_factor": 2, "out_hidden_size": 64,
                                           "deepstack_visual_indexes": [0]}),
    "instructblip": Recipe(_prompted(_square(16), 4), {"image_size": 16, "patch_size": 4},
                           {"word_embed_proj_dim": 64, "ffn_dim": 128},
                           top={"num_query_tokens": 8, "qformer_config": _QFORMER}),
    "instructblipvideo": Recipe(_prompted(_frames(16, 2), 4), {"image_size": 16, "patch_size": 4},
                                {"word_embed_proj_dim": 64, "ffn_dim": 128},
                                top={"num_query_tokens": 4, "qformer_config": _QFORMER},
                                features="get_video_features", placeholder=VIDEO),
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
    # EXAONE 4.5: Qwen2.5-VL's vision tower before a 1-D RoPE text model; its text config names MRoPE sections that
    # its rotary never reads (the MRoPE ids must not reach it)
    "exaone4_5": Recipe(_patches(8, 24), {**_QWEN, "window_size": 8, "fullatt_block_indexes": [1],
                                          "num_key_value_heads": 2}, {"rope_parameters": MROPE}),
    # GLM-4V-MoE: GLM-4V with a MoE text model that hands its decoder layers the MRoPE rows (its attention's
    # position check reads the text row the cut handed it)
    "glm4v_moe": Recipe(_patches(8, 24), {**_QWEN, "image_size": 16},
                        {"rope_parameters": MROPE, "n_routed_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1},
                        top={"image_start_token_id": START, "image_end_token_id": END}, mm_token_type_ids=True),
    # HunYuan-VL: XD-RoPE's 4 axes (text, width, height, image index), a row-newline and begin / end feature per image
    "hunyuan_vl": Recipe(_patches(6, 48), {"patch_size": 4, "max_image_size": 32, "text_hidden_size": 64},
                         {"rope_parameters": {**MROPE, "mrope_section": [2, 2, 2, 2]}}, mm_token_type_ids=True),
    # the Qwen omni thinkers: images only (their audio tower built tiny, given no audio: its gradient 0 on both sides)
    "qwen2_5_omni_thinker": Recipe(_patches(8, 24), {**_QWEN, "window_size": 8, "fullatt_block_indexes": [1]},
                                   {"rope_parameters": MROPE}, top={"audio_config": _AUDIO}),
    "qwen3_omni_moe_thinker": Recipe(_patches(8, 24), {**_QWEN, "num_position_embeddings": 16,
                                                       "deepstack_visual_indexes": [0]},
                                     {"rope_parameters": {**MROPE, "mrope_interleaved": True}, "num_experts": 4,
                                      "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
                                     top={"audio_config": {**_AUDIO, "downsample_hidden_size": 16}}),
    "qwen4_exp": Recipe(_patches(8, 24), {**_QWEN, "num_position_embeddings": 16},
                        {"rope_parameters": {**MROPE, "mrope_interleaved": True},
                         "layer_types": ["linear_attention", "indexed_attention"], "num_experts": 4,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                         "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "hc_lowrank": 8, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                         "indexer_head_dim": 16, "indexer_budget": 16, "indexer_compress_ratio": 4},
                        mm_token_type_ids=True),
    "glm5_next": Recipe(_patches(8, 24), {**_QWEN, "image_size": 16, "projection_intermediate_size": 64},
                        {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_head_dim": 16,
                         "v_head_dim": 16, "qk_rope_head_dim": 0, "head_dim": 0, "num_key_value_heads": 4,
                         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "mlp_layer_types": ["dense", "sparse"],
                         "layer_types": ["linear_attention", "indexed_attention"], "indexer_types": ["full", "full"],
                         "index_topk": 16, "index_head_dim": 16, "index_n_heads": 2, "index_kpool": 4,
                         "linear_head_dim": 16, "linear_num_heads": 4, "hc_mult": 2, "hc_sinkhorn_iters": 3},
                        top={"image_start_token_id": START, "image_end_token_id": END}),
    "glmga": Recipe(_patches(8, 24), {**_QWEN, "image_size": 16}, {"rope_parameters": MROPE},  # GLM-4.6V's model
                    top={"image_start_token_id": START, "image_end_token_id": END}, mm_token_type_ids=True),
    # ERNIE 4.5-VL-MoE: text and vision experts, routed by moe_mm_token_type_ids (cut with the sequence)
    "ernie4_5_vl_moe": Recipe(_patches(8, 12), {"patch_size": 2},
                              {"rope_parameters": {**MROPE, "mrope_section": [3, 3, 2]}, "moe_num_experts": 4,
                               "moe_k": 2, "moe_num_shared_experts": 1, "moe_intermediate_size": [32, 32],
                               "mlp_layer_types": ["dense", "sparse"]},
                              top={"image_start_token_id": START, "image_end_token_id": END}, mm_token_type_ids=True,
                              moe_mm_token_type_ids=True),
    "hy_v4_vl": Recipe(_patches(6, 48), {"patch_size": 4, "max_image_size": 32, "out_hidden_size": 64,
                                         "num_key_value_heads": 2},
                       {"rope_parameters": {**MROPE, "mrope_interleaved": True}, "qk_rope_head_dim": 16,
                        "qk_nope_head_dim": 16, "qk_head_dim": 32, "v_head_dim": 16, "q_lora_rank": 32,
                        "kv_lora_rank": 32, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"],
                        "layer_types": ["indexed_attention"] * 2, "indexer_types": ["full", "shared"], "index_topk": 16,
                        "index_head_dim": 16, "index_n_heads": 2, "hc_mult": 2}, mm_token_type_ids=True),
    "minimax_m3_vl": Recipe(_patches(8, 24), {"patch_size": 2, "temporal_patch_size": 2, "image_size": 16},
                            {"rotary_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                             "dense_intermediate_size": 128, "shared_intermediate_size": 32,
                             "mlp_layer_types": ["dense", "sparse"], "layer_types": ["full_attention"] * 2},
                            top={"projector_hidden_size": 64, "merged_hidden_size": 256}),
    "kimi_k25": Recipe(_patch_images(8, 4), {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8},
                       {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                        "qk_head_dim": 32, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                        "num_key_value_heads": 4, "n_group": 1, "topk_group": 1}, top={"projection_hidden_size": 32}),
    "step3p7": Recipe(_square(32), {"image_size": 32, "patch_size": 4, "max_position_embeddings": 64},
                      {"query_pre_attn_scalar": 16, "num_local_experts": 4, "n_routed_experts": 4,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "share_expert_dim": 32,
                       "mlp_layer_types": ["dense", "sparse"], "sliding_window": 16}),  # sliding: built, unused
    # Molmo2: every image token of a row attends to every other (one bidirectional block over the row's images)
    "molmo2": Recipe(_pooled_crops(16, 48), {"image_size": [16, 16], "patch_size": 4, "num_position_embeddings": 16,
                                             "num_key_value_heads": 2},
                     top={"adapter_config": {"vision_feature_layer": [-1], "hidden_size": 32, "num_attention_heads": 2,
                                             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
                                             "text_hidden_size": 64},
                          "image_patch_id": IMAGE}, mm_token_type_ids=True),  # not video_token_id's, mapped alike
    "dots3_note": Recipe(_patches(8, 12), {"patch_size": 2}, {"head_dim": 32, "num_key_value_heads": 4},
                         init={"text_config": {**TEXT, **_DOTS3_TEXT}, "vision_config": _DOTS3_VISION,
                                "audio_config": {**_AUDIO, "hidden_size": 32, "intermediate_size": 64,
                                                 "num_hidden_layers": 1, "num_attention_heads": 2,
                                                 "adapter_input_size": 32, "adapter_out_dim": 64,
                                                 "downsample_hidden_size": 16, "feature_size": 16}}),
})  # fmt: skip

_INKLING2_VISION = dict(patch_size=2, spatial_merge_size=2, posemb_grid_size=4, projection_hidden_dim=64,
                        text_hidden_size=64)  # fmt: skip
_INKLING2_TEXT = dict(unpadded_vocab_size=VOCAB, layer_types=["hybrid_sliding", "hybrid"], swa_num_attention_heads=4,
                      swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=16, d_rel=8, rel_extent=16,
                      moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                      n_layers_per_attn_res_block=1)  # fmt: skip
_MUSE_VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16, patch_temporal=2,
                    merge_size=2, layer_types=["window_attention", "full_attention"])  # fmt: skip
_MUSE_TEXT = dict(layer_types=["sliding_attention", "full_attention"], layer_rope_theta=[10_000.0, 0],
                  sliding_window=16)  # fmt: skip
"""Muse Glimmer's tiny towers: 4 × 4-patch windows over 8 × 8-patch images; a sliding RoPE layer and a full NoPE one."""
_OCR2_SAM = dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                 patch_size=4, window_size=4, global_attn_indexes=[1], mlp_dim=64,
                 downsample_channels=[16, 32])  # fmt: skip
_OCR2_ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, max_position_embeddings=256, vocab_size=VOCAB)  # fmt: skip
"""DeepSeek-OCR-2's SAM (8 × 8 patches, 2 × 2 after its neck) and its query encoder (144 learned queries: 145 tokens
per image with the view separator, so its rows hold 512 tokens)."""
RECIPES.update({  # group d
    "cosmos3_omni": Recipe(_patches(8, 24), {**_QWEN, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
                           {"rope_parameters": {**MROPE, "mrope_interleaved": True}}, mm_token_type_ids=True),
    "cohere_compass": Recipe(_patches(8, 24), {**_QWEN, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
                             {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
                              "rope_parameters": {"sliding_attention": MROPE, "full_attention": None}},
                             mm_token_type_ids=True),
    "hyperclovax_vision_v2": Recipe(_patches(8, 24), {**_QWEN, "window_size": 8, "fullatt_block_indexes": [1]}),
    "cosmos3_edge": Recipe(_patches(8, 12), {"patch_size": 2, "spatial_merge_size": 2, "num_patches": 16},
                           {"rope_parameters": MROPE}, top={"projector_hidden_size": 64}, mm_token_type_ids=True),
    "deepseek_ocr2": Recipe(_square(32), {"sam_config": _OCR2_SAM, "encoder_config": _OCR2_ENCODER},
                            {"n_routed_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                             "n_shared_experts": 1, "mlp_layer_types": ["dense", "sparse"],
                             "max_position_embeddings": 2048}, seq=512),
    "deepseek_vl_hybrid": Recipe(_low_and_high(16, 32), {"image_size": 16, "patch_size": 4},
                                 top={"high_res_vision_config": {"image_size": 32, "patch_size": 4, "hidden_size": 32,
                                                                 "output_channels": 16, "num_hidden_layers": 2,
                                                                 "num_attention_heads": 2, "mlp_dim": 64,
                                                                 "global_attn_indexes": [1], "window_size": 4}}),
    "minicpmv4_6": Recipe(_packed(8, 2), {"image_size": 16, "patch_size": 2, "insert_layer_id": 0},
                          {"layer_types": ["linear_attention", "full_attention"]}, top={"insert_layer_id": 0}),
    "minicpmv4_7": Recipe(_packed(8, 2), {"image_size": 16, "patch_size": 2, "insert_layer_id": 0},
                          {"layer_types": ["linear_attention", "full_attention"],
                           "rope_parameters": {**MROPE, "mrope_interleaved": True}},
                          top={"insert_layer_id": 0, "image_start_id": START, "image_end_id": END,
                               "slice_start_id": 7, "slice_end_id": 1, "newline_id": 2}, mm_token_type_ids=True),
    "nemotron_h_omni": Recipe(_patches_hw(8, 48), {"patch_size": 4, "patch_dim": 48, "video_patch_dim": 96,
                                                   "max_img_size": 32, "image_size": 32},
                              {"mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
                               "chunk_size": 8, "n_routed_experts": 4, "moe_intermediate_size": 32,
                               "moe_shared_expert_intermediate_size": 32, "num_experts_per_tok": 2},
                              top={"vision_hidden_size": 32, "projector_hidden_size": 64}),
    "inkling2": Recipe(_merged_patches(4, 4), _INKLING2_VISION, _INKLING2_TEXT),
    "inkling2_loop": Recipe(_merged_patches(4, 4), _INKLING2_VISION, _INKLING2_TEXT),
    "inkling_mm_model": Recipe(_tubelets(2, 4), {"patch_size": 4, "temporal_patch_size": 2, "num_hidden_layers": 4,
                                                 "text_hidden_size": 64},
                               {**_INKLING2_TEXT, "mlp_layer_types": ["dense", "sparse"], "n_shared_experts": 1},
                               top={"audio_config": {"text_hidden_size": 64, "mel_vocab_size": 16, "n_mel_bins": 8}}),
    "muse_glimmer": Recipe(_patches(8, 24), _MUSE_VISION, _MUSE_TEXT,
                           top={"out_hidden_size": 128, "projector_hidden_size": 64}),
    "apertus1p5": Recipe(_square(16), {"codebook_size": 16, "embed_dim": 8, "latent_channels": 8, "base_channels": 32,
                                       "channel_multiplier": [1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [],
                                       "resolution": 16, "spatial_scale_factor": 4},
                         top={"image_token_offset": 8}, image_sizes=16),
    "muse_spark": Recipe(_patches(8, 24), _MUSE_VISION,
                         {**_MUSE_TEXT, "mlp_layer_types": ["dense", "sparse"], "moe_hidden_size": 32,
                          "moe_intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
                         top={"out_hidden_size": 128, "projector_hidden_size": 64,
                              "audio_config": {"patch_sizes": [2, 2, 2, 2], "hidden_sizes": [16, 16, 16, 16],
                                               "depths": [1, 1, 1, 1], "out_hidden_size": 64}}),
})  # fmt: skip

EXPECTED_REFUSALS: dict[str, str] = {}
"""Family → the refusal it gets (Gemma 3's image spans and PaliGemma's prefix are computed: issue 45)."""

EXPECTED_REFUSALS.update({  # group a
    "chameleon": r"has a tower \(model.vqmodel, built from ChameleonVQVAEConfig\) and no language model of its own",
    "kosmos-2": r"calls its language model \(text_model.model\) with image_embeds of shape",  # merged inside it
    "kosmos-2.5": r"calls its language model \(text_model.model\) with image_embeds of shape",
})  # fmt: skip

EXPECTED_REFUSALS.update({  # group b
    # its DeepSeek sparse attention: an indexer picks each query's top-k keys into the mask, as DeepSeek-V3.2's
    "mistral_large4": r"uses its attention mask as a tensor .* train this model without sequence parallelism",
    # its "reference" sliding window: the window OR'd with the prefill (all of it, in training: causal)
    "unlimited_ocr": r"UnlimitedOcrTextAttention is given a mask with an OR of masks .*create_reference_sliding_window",
})  # fmt: skip

EXPECTED_REFUSALS.update({  # group c
    "qwen4_exp": r"Conv1d \(at layers.0.linear_attn.conv1d\) mixes information along the sequence",  # as its text model
    "glm5_next": r"Conv1d \(at layers.0.self_attn.conv1d\) mixes information along the sequence",  # its KDA layers
    "hy_v4_vl": r"uses its attention mask as a tensor",  # its DSA indexer's top-k mask, as HY-V4's text model
    "dots3_note": r"uses its attention mask as a tensor",  # its DSA indexer's top-k mask, as its text model
    "molmo2": r"a block \(id 0\) of tokens that are not consecutive",  # a row's 2 images: one block with text between
})  # fmt: skip

_SHORT_CONVOLUTION = r"ShortConvolution \(at \S*sconv\) mixes information along the sequence"
"""Inkling 2's short convolutions along the sequence; given eager attention alone (``_supports_attention_backend`` is
False) it is refused for computing attention in its own code instead, also true."""
EXPECTED_REFUSALS.update({  # group d
    "inkling2": _SHORT_CONVOLUTION,
    "inkling2_loop": _SHORT_CONVOLUTION,
    "inkling_mm_model": r"Conv1d \(at \S*sconv\S*\) mixes information along the sequence",  # its short convolutions
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
    if "text_config" not in recipe.init and (hasattr(config, "text_config") or not recipe.init):  # else: init made it
        _set(getattr(config, "text_config", config), {**TEXT, **recipe.text})  # Chameleon's text fields are its own
    if getattr(config, "vision_config", None) is not None:  # Fuyu's vision side is one linear layer, no config
        _set(config.vision_config, {**VISION, **recipe.vision})
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


def image_tokens(model: torch.nn.Module, images: dict[str, torch.Tensor], method: str = "get_image_features") -> int:
    """How many placeholder tokens each image takes: the rows the model's own image features (``method``) have, per
    image."""
    inner = getattr(model, "model", model)
    features = getattr(inner, method)(**images, return_dict=True)
    pooled = getattr(features, "pooler_output", features)
    if pooled is None:  # Llama 4: its projector runs in the model's forward, on the vision model's last hidden state
        pooled = features.last_hidden_state
    parts = pooled if isinstance(pooled, list | tuple) else [pooled]
    rows = sum(part.reshape(-1, part.shape[-1]).shape[0] for part in parts)
    return rows // (BATCH * IMAGES_PER_ROW)


def batch(family: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full batch as the family's processor makes it: ``input_ids [BATCH, S]`` (``S``: :data:`SEQ` or the
    recipe's ``seq``) with two images per row, the first at token 4 (across S/4, a zigzag chunk boundary of 2 ranks),
    the second across S/2; labels -100 at
    the image tokens; the images and the family's extra inputs."""
    recipe = RECIPES[family]
    images = recipe.images(BATCH * IMAGES_PER_ROW)
    if recipe.image_sizes:
        images["image_sizes"] = torch.tensor([[recipe.image_sizes] * 2] * (BATCH * IMAGES_PER_ROW))
    tokens = recipe.tokens_per_image  # a text-only family of the mapping (Mistral 4), no images: rows of text
    if images and not tokens:
        with torch.no_grad(), Float64Throughout():
            doubled = {k: v.double() if v.is_floating_point() else v for k, v in images.items()}
            tokens = image_tokens(model, doubled, recipe.features)
    seq = recipe.seq
    starts = [4, seq // 2 - tokens // 2]
    if images and (tokens == 0 or starts[0] + tokens >= starts[1] - 1):
        raise ValueError(f"{tokens} tokens per image do not fit twice in {seq}")
    input_ids = torch.randint(8, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    is_image = torch.zeros(BATCH, seq, dtype=torch.bool)
    for start in starts if images else []:
        input_ids[:, start - 1], input_ids[:, start + tokens] = START, END
        is_image[:, start : start + tokens] = True
    input_ids[is_image] = recipe.placeholder
    labels = input_ids.masked_fill(is_image, -100)
    full = {"input_ids": input_ids, "labels": labels, **images}
    if recipe.mm_token_type_ids:
        full["mm_token_type_ids"] = is_image.long()
    if recipe.image_mask:
        full[recipe.image_mask] = is_image.long()
    if recipe.moe_mm_token_type_ids:
        full["moe_mm_token_type_ids"] = (is_image | (input_ids == START) | (input_ids == END)).long()
    if recipe.token_type_ids == "image":
        full["token_type_ids"] = is_image.long()
    elif recipe.token_type_ids == "suffix":
        full["token_type_ids"] = (torch.arange(seq) >= seq // 2 + tokens).long().expand(BATCH, seq).clone()
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
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_ring.integrations.hf import register_with_transformers
    from ds_ring.integrations.hf.registration import OWN_NAME

    implementation = "sdpa"
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:  # a language model that allows no sdpa (HY-V4-VL's): ds_ring's own registry entry for it, as
        if OWN_NAME not in ALL_ATTENTION_FUNCTIONS:  # tests/zoo.py does, and sdpa for the vision tower
            ALL_ATTENTION_FUNCTIONS[OWN_NAME] = ALL_ATTENTION_FUNCTIONS["sdpa"]
        implementation = OWN_NAME
        try:
            model.set_attn_implementation({"": OWN_NAME, "text_config": OWN_NAME, "vision_config": "sdpa"})
        except ValueError:  # a tower that allows no sdpa (Apertus 1.5's VQ tokenizer): sdpa for the text model only,
            implementation = "sdpa"  # the towers eager, and registration judges it
            model.set_attn_implementation({"text_config": "sdpa"})
    config = {"train_micro_batch_size_per_gpu": BATCH, "ring_attention": {"timeout_s": 60, **section}}
    session = register_with_transformers(model, core_attn_implementation=implementation, config=config,
                                         topology=topology, divide_vision=divide_vision)  # fmt: skip
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
    whatever its inputs: an encoder-decoder model
    (:func:`~ds_ring.integrations.hf.vision.refuse_encoder_decoder`, the check registration makes first), or what
    :func:`~ds_ring.integrations.hf.vision.vision_language` refuses of the model built on the meta device (no language
    model to cut before, the merge inside its decoder, a language model that cross-attends to the images); ``""``
    otherwise."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from ds_ring.integrations.hf.vision import refuse_encoder_decoder, vision_language

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
    try:
        found = vision_language(model, None, "contiguous", divide=False)
    except ValueError as err:
        return f"refused: {err}"
    if found is not None:
        found.remove()
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
random weights, float64 throughout; {BATCH} rows × {SEQ} tokens (more where a recipe's `seq` says) with
{IMAGES_PER_ROW} images per row, one
across the middle of the row (the shard boundary of 2 ranks) and one across a zigzag chunk boundary, on 2
ranks. *equal*: the loss and each parameter's gradient (summed over the ranks; the vision tower's included)
equal the whole model's with `eager` attention to {TOLERANCE:g} relative to that parameter's own largest
gradient; the last column names the worst parameter and its error, rounded up to a power of ten."""
    title = "transformers' vision-language zoo under ds_ring"
    return page(title, about, outcomes, f"Not run here ({len(skipped)})", skipped, seconds)


if __name__ == "__main__":
    main(out="docs/vlm_zoo.md", zoo=run, every=families, strategies=STRATEGIES, page=table, description=__doc__)
