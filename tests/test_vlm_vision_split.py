"""A Qwen-style vision encoder divided over 2 ranks by frames equals the whole model, and each rank encodes its frames.

Tiny float64 Qwen2-VL, Qwen2.5-VL (window attention) and Qwen3-VL (deepstack) on a row holding a video of 4 frames
across the shard boundary and an image: each rank encodes two of the video's frames (the encoder's video call divided),
and both encode the image (a call of fewer frames than ranks is not divided).
With ``divide_vision`` on and off, the loss and every parameter's gradient (the vision tower's included) summed over
the ranks equal the whole model's; with it on, each rank's patch embedding sees its frames' patches only, and the
activations the encoder saves for backward on a rank are about half the whole encoder's. A module that merges frames
(ERNIE 4.5-VL-MoE's resampler) is not divided; an encoder whose output is not rows per patch (MiniMax-M3-VL's
first-patch ``pooler_output``) is encoded whole.
"""

from __future__ import annotations

import pytest
import torch

from ds_ring.testing import rank_results, spawn_ranks
from launch.train_vlm import SavedActivations
from tests import vlm_zoo
from tests.zoo import TOLERANCE, Float64Throughout, worst_error

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
GRID = 4  # patches per side: 4 tokens per frame after the 2 × 2 merge
VIDEO_FRAMES = 4


def video_batch(family: str) -> dict[str, torch.Tensor]:
    """One row of 64 tokens: a video of 4 frames (16 tokens) across the middle, then an image (4 tokens). Qwen3-VL's
    processor puts each frame in its own run (a timestamp between frames): there the frames are 6 tokens apart."""
    generator = torch.Generator().manual_seed(3)
    seq, per_frame = vlm_zoo.SEQ, GRID * GRID // 4
    input_ids = torch.randint(8, vlm_zoo.VOCAB, (1, seq), generator=generator)
    kinds = torch.zeros(1, seq, dtype=torch.long)
    step = per_frame + 2 if family == "qwen3_vl" else per_frame
    first = seq // 2 - VIDEO_FRAMES * step // 2
    for frame in range(VIDEO_FRAMES):
        video = slice(first + frame * step, first + frame * step + per_frame)
        input_ids[0, video], kinds[0, video] = vlm_zoo.VIDEO, 2
    image = slice(50, 50 + per_frame)
    input_ids[0, image], kinds[0, image] = vlm_zoo.IMAGE, 1
    labels = input_ids.masked_fill(kinds > 0, -100)
    patch = 3 * 2 * 2 * 2
    return {
        "input_ids": input_ids,
        "labels": labels,
        "mm_token_type_ids": kinds,
        "pixel_values_videos": torch.randn(VIDEO_FRAMES * GRID * GRID, patch, generator=generator).double(),
        "video_grid_thw": torch.tensor([[VIDEO_FRAMES, GRID, GRID]]),
        "pixel_values": torch.randn(GRID * GRID, patch, generator=generator).double(),
        "image_grid_thw": torch.tensor([[1, GRID, GRID]]),
    }


def _split_ranks(rank: int, world: int) -> dict:
    import transformers

    import ds_ring

    transformers.logging.set_verbosity_error()
    topology = ds_ring.Topology(*ds_ring.load_config({"ring_attention": {"strategy": "ring"}}).degrees(world))
    results = {}
    for family in FAMILIES:
        model = vlm_zoo.build(family)
        full = video_batch(family)
        with Float64Throughout():
            loss, grads = vlm_zoo.reference(model, full)
        encoder = model.model.visual
        patches: list[int] = []

        def count(_module: torch.nn.Module, args: tuple, _out: object, seen: list[int] = patches) -> None:
            seen.append(args[0].shape[0])

        handle = encoder.patch_embed.register_forward_hook(count)
        for divide in (True, False):
            patches.clear()
            saved = SavedActivations(encoder)
            with Float64Throughout():
                got_loss, got = vlm_zoo.sequence_parallel(model, full, {"strategy": "ring"}, topology, divide)
            saved.remove()
            error = worst_error(got_loss, got, loss, grads)
            results[family, divide] = (error.value, str(error), list(patches), sum(saved.calls))
        handle.remove()
    return results


@pytest.mark.timeout(1800)
def test_frames_divided_over_ranks_equal_the_whole_model():
    per_rank = rank_results(spawn_ranks(_split_ranks, 2, timeout_s=1800))
    whole_patches = [GRID * GRID, VIDEO_FRAMES * GRID * GRID]  # the image's call, then the video's
    for family in FAMILIES:
        for rank, results in enumerate(per_rank):
            for divide in (True, False):
                value, detail, patches, _ = results[family, divide]
                assert value <= TOLERANCE, f"{family} rank {rank} divide_vision={divide}: {detail}"
                if not divide:
                    assert patches == whole_patches, (family, rank, patches)
            divided = results[family, True][2]
            assert divided == [GRID * GRID, VIDEO_FRAMES // 2 * GRID * GRID], (family, rank, divided)
            # saved for backward: 2 of 4 video frames and the image, of 4 frames and the image (0.6 of the patches)
            assert results[family, True][3] < 0.7 * results[family, False][3], (family, rank, results[family, True])


def test_a_module_that_merges_frames_is_not_divided():
    """ERNIE 4.5-VL-MoE's resampler (after its encoder) has ``spatial_merge_size`` and ``forward(hidden_states,
    grid_thw)`` too, but merges pairs of frames (``temporal_merge_size`` 2): only its encoder is divided (the resampler
    was, and returned a plain tensor the gather refused)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from ds_ring.integrations.hf.vision_split import frame_encoders

    config = vlm_zoo.tiny_config("ernie4_5_vl_moe")
    with torch.device("meta"):
        model = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]._from_config(config)
    assert model.model.resampler_model.temporal_merge_size == 2
    assert frame_encoders(list(model.modules())) == [model.model.vision_tower]


def test_an_encoder_output_that_is_not_rows_per_patch_is_encoded_whole():
    """MiniMax-M3-VL's encoder (``forward(pixel_values, grid_thw)``, called by name) returns a ``pooler_output`` of
    its first patch's row, which no gather of the ranks' rows makes the whole call's: that call is encoded again
    whole, and every later call whole from the start (no exchange: the ranks find it alike)."""
    from types import SimpleNamespace

    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from ds_ring.integrations.hf.vision_split import FrameSplit

    class Encoder(torch.nn.Module):
        spatial_merge_size = 1

        def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> BaseModelOutputWithPooling:
            self.seen = pixel_values.shape[0]
            return BaseModelOutputWithPooling(last_hidden_state=2 * pixel_values, pooler_output=pixel_values[:1])

    topology = SimpleNamespace(sequence_parallel_group=object(), get_sequence_parallel_world_size=lambda: 2,
                               get_sequence_parallel_rank=lambda: 1, timeout_s=1.0)  # fmt: skip
    encoder, pixels, grid = Encoder(), torch.arange(8.0)[:, None], torch.tensor([[2, 2, 2]])
    split = FrameSplit(encoder, topology)
    first = encoder(pixel_values=pixels, grid_thw=grid)
    assert split.whole and encoder.seen == 8 and torch.equal(first.last_hidden_state, 2 * pixels)
    assert torch.equal(first.pooler_output, pixels[:1])
    encoder(pixels, grid)
    assert encoder.seen == 8  # not divided


def _keyword_ranks(rank: int, world: int) -> dict:
    import transformers

    import ds_ring

    transformers.logging.set_verbosity_error()
    topology = ds_ring.Topology(*ds_ring.load_config({"ring_attention": {"strategy": "ring"}}).degrees(world))
    model = vlm_zoo.build("muse_glimmer")
    full = vlm_zoo.batch("muse_glimmer", model)
    with Float64Throughout():
        loss, grads = vlm_zoo.reference(model, full)
    patches: list[int] = []

    def count(_module: torch.nn.Module, args: tuple, kwargs: dict, _out: object) -> None:
        patches.append((args[0] if args else kwargs["pixel_values"]).shape[0])

    handle = model.model.vision_tower.patch_embedder.register_forward_hook(count, with_kwargs=True)
    results = {}
    for divide in (True, False):
        patches.clear()
        with Float64Throughout():
            got_loss, got = vlm_zoo.sequence_parallel(model, full, {"strategy": "ring"}, topology, divide)
        error = worst_error(got_loss, got, loss, grads)
        results[divide] = (error.value, str(error), list(patches))
    handle.remove()
    return results


@pytest.mark.slow  # 27 s on 2 cores at a load of 15: CI's second step
@pytest.mark.timeout(1800)
def test_an_encoder_called_by_keyword_that_merges_by_merge_size_is_divided_and_equals_the_whole_model():
    """Muse Glimmer calls its vision tower with ``pixel_values=`` (not ``hidden_states``) and merges 2 × 2 patches by
    its ``merge_size`` after a ``spatial_merge_size`` of 1: divided, each rank encodes 2 of the 4 images (64 patches
    each), and its rows per merged patch are gathered; divided and whole equal the whole model."""
    for rank, results in enumerate(rank_results(spawn_ranks(_keyword_ranks, 2, timeout_s=1800))):
        for divide, (value, detail, patches) in results.items():
            assert value <= TOLERANCE, f"rank {rank} divide_vision={divide}: {detail}"
            assert patches == [(2 if divide else 4) * 64], (rank, divide, patches)
