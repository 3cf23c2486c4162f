"""Vision-language masks read from transformers' compositions and computed as ds_ring's bidirectional spans.

- :func:`mask_spec` reads ``or_masks(causal, blockwise_overlay(ids))`` into spans: Gemma 3's image tokens (full
  layers, and ``AND(window, OR(causal, images))`` on sliding ones), Gemma 4's ``OR(AND(window, causal), images)``,
  PaliGemma's prefix, under the packed-sequence remap (marked); any other OR, a non-consecutive block and a
  blockwise overlay alone stay refused by name.
- A tiny float64 ``Gemma3ForConditionalGeneration`` (text tokens given Gemma-3-style ``token_type_ids``: two images,
  one straddling a shard boundary; no pixels) on 2 and 4 gloo ranks, ring (contiguous, zigzag), Ulysses and hybrid
  2 × 2, ``token_type_ids`` given whole by ``shard_batch(..., whole=("token_type_ids",))``: gathered logits, loss and
  every parameter gradient equal the whole model's (``sdpa`` on transformers' own mask tensor), with the sliding
  layer's window longer than the sequence and of 8 tokens; sharded ``token_type_ids`` and an image longer than the
  window are refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import masking_utils as mu

import ds_ring
from ds_ring.integrations.hf import causal_lm_loss, register_with_transformers, shard_batch
from ds_ring.integrations.hf.masks import Blocks, MaskSpec, mask_spec
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.hf_cases import STRATEGIES, Result, assert_same, ds_config, shifted, strategies_for, topology_for

# transformers before blockwise_overlay (5.0, the lowest declared) builds Gemma 3's image mask from its own closure,
# which ds_ring refuses by name as an unknown OR: there is nothing of this module to run
pytestmark = pytest.mark.skipif(
    not hasattr(mu, "blockwise_overlay"), reason="transformers without masking_utils.blockwise_overlay"
)

SEQ, VOCAB = 32, 128


def _ids(spans: list[tuple[int, int]], seq: int = 16) -> torch.Tensor:
    ids = torch.full((1, seq), -1)
    for n, (a, b) in enumerate(spans):
        ids[0, a:b] = n
    return ids


def test_image_spans_are_read_from_the_or():
    ids = _ids([(2, 6), (9, 12)])
    spans = Blocks((((2, 6), (9, 12)),), 16)
    full = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids))
    assert mask_spec(full) == MaskSpec(causal=True, window=None, blocks=spans)
    sliding = mu.and_masks(full, mu.sliding_window_overlay(8))  # Gemma 3's AND(window, OR(causal, images))
    assert mask_spec(sliding) == MaskSpec(causal=True, window=8, blocks=spans)
    gemma4 = mu.or_masks(mu.sliding_window_causal_mask_function(8), mu.blockwise_overlay(ids))  # OR(AND(w, c), b)
    assert mask_spec(gemma4) == MaskSpec(causal=True, window=8, blocks=spans)
    packed = mu.and_masks(full, mu.packed_sequence_mask_function(torch.zeros(1, 16, dtype=torch.long)))
    assert mask_spec(packed).blocks == spans
    remapped = mu.remap_positions_for_packed_sequence(full, torch.arange(16)[None])  # transformers' sliding layers
    assert mask_spec(remapped).blocks == Blocks(spans.rows, 16, remapped=True)
    prefix = torch.where(torch.arange(16) < 5, 0, -1)[None]  # PaliGemma: token_type_ids == 0 -> block 0
    assert mask_spec(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(prefix))).blocks == Blocks(
        (((0, 5),),), 16
    )
    two_rows = torch.cat([_ids([(2, 6)]), _ids([(3, 4), (5, 9)])])
    assert mask_spec(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(two_rows))).blocks == Blocks(
        (((2, 6),), ((5, 9),)), 16
    )


@pytest.mark.parametrize(
    ("function", "named"),
    [
        (lambda: mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function), "an OR of masks"),
        (lambda: mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: q > k), "an OR of masks"),
        (lambda: mu.blockwise_overlay(_ids([(2, 6)])), "outside an OR with causal"),
        (
            lambda: mu.or_masks(
                mu.causal_mask_function,
                mu.and_masks(mu.sliding_window_overlay(8), mu.blockwise_overlay(_ids([(2, 6)]))),
            ),
            "an OR of masks",
        ),
        (
            lambda: mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(torch.tensor([[0, 0, -1, 0]]))),
            "not consecutive",
        ),
    ],
)
def test_other_ors_are_refused_by_name(function, named):
    spec = mask_spec(function())
    assert spec.unsupported is not None and named in spec.unsupported, spec


def test_a_spec_handed_on_is_returned_as_is(monkeypatch):
    """PaliGemma builds its prefix mask, then hands it to its Gemma, which builds a mask again from the one it is
    given: transformers returns a built 4-D mask as is, and ds_ring's spec alike (the prefix kept, not dropped)."""
    from transformers import GemmaConfig

    from ds_ring.integrations.hf.registration import _no_mask

    monkeypatch.setitem(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "ds_ring_spec_test", _no_mask)
    config = GemmaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8)
    config._attn_implementation = "ds_ring_spec_test"
    embeds, positions = torch.zeros(1, 16, 16), torch.arange(1, 17)[None]
    prefix = torch.where(torch.arange(16) < 6, 0, -1)[None]
    built = mu.create_causal_mask(
        config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions,
        block_sequence_ids=prefix,
    )  # fmt: skip
    assert built == MaskSpec(causal=True, window=None, blocks=Blocks((((0, 6),),), 16))
    assert built.shape == (1, 1, 16, 16)
    again = mu.create_causal_mask(
        config=config, inputs_embeds=embeds[:, :8], attention_mask=built, cache=None, position_ids=positions[:, :8]
    )
    assert again is built


def gemma3_vlm(sliding_window: int = 4 * SEQ) -> torch.nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=256,
                            sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
                            use_cache=False)  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=127,
                          boi_token_index=125, eoi_token_index=126)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(config).double()


def vlm_batch() -> dict[str, torch.Tensor]:
    """One row of text tokens, two "images" by ``token_type_ids``: one inside the first quarter, one straddling the
    middle (a shard boundary at 2 and at 4 ranks)."""
    input_ids = torch.randint(0, 100, (1, SEQ), generator=torch.Generator().manual_seed(1))
    token_types = torch.zeros(1, SEQ, dtype=torch.long)
    token_types[0, 2:6] = 1
    token_types[0, SEQ // 2 - 5 : SEQ // 2 + 3] = 1
    labels = input_ids.clone()
    labels[0, :2] = -100
    return {"input_ids": input_ids, "token_type_ids": token_types, "labels": labels}


def _whole(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Result:
    model.zero_grad()
    out = model(**batch)
    loss = F.cross_entropy(out.logits.flatten(0, 1), shifted(batch["labels"]).flatten(), ignore_index=-100)
    loss.backward()
    return Result(out.logits.detach(), out.loss.detach(), _grads(model))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of the parameters that have one (the vision tower gets none: no pixels)."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _sharded(model: torch.nn.Module, batch: dict[str, torch.Tensor], session, **options) -> Result:
    sharded = shard_batch(session, batch, **options)
    model.zero_grad()
    logits = model(**{k: v for k, v in sharded.items() if k != "shift_labels"}).logits
    loss = causal_lm_loss(session, logits, sharded["shift_labels"])
    loss.backward()
    group = session.topology.sequence_parallel_group
    grads = _grads(model)
    for grad in grads.values():
        dist.all_reduce(grad, group=group)
    gathered = ds_ring.gather_sequence(logits.detach(), group, layout=session.section.layout)
    return Result(gathered, loss.detach(), grads)


def _rank(rank: int, world: int) -> list[str]:
    log, topologies = CaseLog(), {}
    batch = vlm_batch()
    for window, model in ((None, gemma3_vlm()), (8, gemma3_vlm(8))):
        _compare(log, model, batch, world, topologies, window)
    section = STRATEGIES["ring"]
    refusals = {
        "sharded token_type_ids": (gemma3_vlm(), {}, "whole=\\('token_type_ids',\\)"),
        "an image longer than the sliding window": (gemma3_vlm(6), {"whole": ("token_type_ids",)}, "window 6"),
    }
    for name, (refused, options, message) in refusals.items():
        with log.case(f"refused: {name}"):
            topology = topology_for(section, world, topologies)
            session = register_with_transformers(
                core_attn_implementation="sdpa", config=ds_config(**section), topology=topology
            )
            try:
                with pytest.raises(ValueError, match=message):
                    _sharded(refused, batch, session, **options)
            finally:
                session.close()
    return log.failures


def _compare(
    log: CaseLog, model: torch.nn.Module, batch: dict, world: int, topologies: dict, window: int | None
) -> None:
    """The model on every strategy against itself whole (``window``: its sliding window, for the case's name)."""
    expected = _whole(model, batch)
    for strategy, section in strategies_for(world).items():
        with log.case(f"gemma3 images, sliding window {window}, {strategy}"):
            topology = topology_for(section, world, topologies)
            session = register_with_transformers(
                core_attn_implementation="sdpa", config=ds_config(**section), topology=topology
            )
            try:
                got = _sharded(model, batch, session, whole=("token_type_ids",))
            finally:
                session.close()
            # Gemma 3's RMSNorm computes in float32 inside the float64 model (as in test_hf_windows_and_sinks)
            assert_same(got, expected, rtol=1e-5, atol=1e-8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: CI's second step (time)
def test_gemma3_image_spans_match_the_whole_model(world):
    assert_no_failures(run_distributed(_rank, world, timeout=260))
