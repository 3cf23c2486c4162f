"""What a model's mask says is read from transformers' mask functions, and what ds_ring cannot compute is named.

:func:`mask_spec` walks the closures of the mask functions transformers composes (no tensor is made);
:func:`check_mask_tensor` compares a mask tensor a model built itself with causal, the window and the documents.
"""

import pytest
import torch
from transformers import masking_utils as mu

from ds_ring.integrations.hf.masks import MaskSpec, check_mask_tensor, mask_spec


def test_causal_and_windowed_masks_are_read():
    assert mask_spec(None) == MaskSpec(causal=True, window=None)
    assert mask_spec(mu.causal_mask_function) == MaskSpec(causal=True, window=None)
    assert mask_spec(mu.sliding_window_causal_mask_function(16)) == MaskSpec(causal=True, window=16)
    assert mask_spec(mu.bidirectional_mask_function) == MaskSpec(causal=False, window=None)
    packed = mu.and_masks(
        mu.sliding_window_causal_mask_function(8), mu.packed_sequence_mask_function(torch.zeros(1, 4))
    )
    assert mask_spec(packed) == MaskSpec(causal=True, window=8)
    offset = mu.add_offsets_to_mask_function(mu.causal_mask_function, 3, 3)
    assert mask_spec(offset) == MaskSpec(causal=True, window=None)


def _unsupported() -> dict[str, tuple]:
    """Compositions ds_ring cannot compute, by what it calls them (those this transformers release defines)."""
    cases = {
        "chunked": lambda: mu.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long)),
        "an OR of masks": lambda: mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function),
        "bidirectional sliding window": lambda: mu.sliding_window_bidirectional_mask_function(4),
        "a mask function of its own": lambda: mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: q > 0),
    }
    built = {}
    for named, make in cases.items():
        try:
            built[named] = make()
        except AttributeError:  # not in this release (transformers 5.0 has no bidirectional window)
            continue
    return built


@pytest.mark.parametrize("named, function", list(_unsupported().items()), ids=list(_unsupported()))
def test_masks_ds_ring_cannot_compute_are_named(named, function):
    spec = mask_spec(function)
    assert spec.unsupported is not None and named in spec.unsupported


def test_a_spec_used_as_a_tensor_raises_a_value_error():
    spec = MaskSpec(causal=True, window=None)
    assert bool(spec)
    for use in (lambda: spec.dtype, lambda: spec[:, 0], lambda: spec + 1, lambda: 1 * spec):
        with pytest.raises(ValueError, match="uses its attention mask as a tensor"):
            use()


def test_a_spec_indexed_whole_is_itself():
    """Gemma 4 slices its masks to ``logits_to_keep`` before its KV-shared layers: ``0`` in training, all of it."""
    spec = MaskSpec(causal=True, window=16)
    assert spec[:, :, slice(-0, None), :] is spec
    assert spec[..., :] is spec
    for part in (slice(-4, None), slice(0, 8), slice(None, None, 2), 0):
        with pytest.raises(ValueError, match="uses its attention mask as a tensor"):
            spec[:, :, part, :]


def _mask(tokens, window=None, allow=None):
    distance = tokens[:, None] - tokens[None, :]
    ok = distance >= 0
    if window is not None:
        ok &= distance < window
    if allow is not None:
        ok[allow] = True
    return ok[None, None]


def test_mask_tensors_are_compared_on_the_shard():
    tokens = torch.arange(8, 16)  # rank 1 of 2, 16 tokens
    assert check_mask_tensor(_mask(tokens), tokens, (0, 16), True, None) is None
    assert check_mask_tensor(_mask(tokens, 4), tokens, (0, 16), True, 4) is None
    assert "blocks position" in check_mask_tensor(_mask(tokens, 4), tokens, (0, 16), True, None)
    assert "allows position" in check_mask_tensor(_mask(tokens, allow=(0, 3)), tokens, (0, 16), True, None)
    additive = torch.zeros(1, 1, 8, 8).masked_fill(~_mask(tokens)[0, 0], float("-inf"))
    assert check_mask_tensor(additive, tokens, (0, 16), True, None) is None
    # a document starting at 12: pairs across it are not compared (ds_ring's documents separate them)
    assert check_mask_tensor(_mask(tokens), tokens, (0, 12, 16), True, None) is None
