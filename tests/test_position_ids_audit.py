"""A position module that numbers a shard's tokens itself, ignoring the batch's ``position_ids``, is refused.

:func:`ds_ring.integrations.hf.positions.refuse_position_blind` runs a model twice (``position_ids`` 0..n-1, then the
second half moved on) and refuses a position embedding whose output did not change: under sequence parallelism every
rank but the first would embed its tokens at the wrong positions. One process, tiny models, no communication; the
registration path itself is covered by ``test_model_zoo.py``'s every-family run (``-m zoo``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_ring.integrations.hf.positions import refuse_position_blind


class _Counted(nn.Module):
    """A made-up position embedding: ``arange(length)`` of the tokens it is given (``position_ids`` ignored), or the
    ``position_ids`` themselves."""

    def __init__(self, reads_position_ids: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(64, 8)
        self.reads = reads_position_ids

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        positions = position_ids if self.reads else torch.arange(input_ids.shape[1])[None]
        return self.table(positions)


class _MadeUpPositionalEmbedding(_Counted):
    pass


class _MadeUpModel(nn.Module):
    def __init__(self, reads_position_ids: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(32, 8)
        self.where = _MadeUpPositionalEmbedding(reads_position_ids)
        self.head = nn.Linear(8, 32)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.head(self.tokens(input_ids) + self.where(input_ids, position_ids))


def _tiny(family: str) -> nn.Module:
    from tests.zoo import build

    return build(family)


def test_a_position_embedding_that_counts_tokens_itself_is_refused_by_what_it_does():
    with pytest.raises(ValueError, match=r"_MadeUpPositionalEmbedding \(at where\) computes positions from the shard"):
        refuse_position_blind(_MadeUpModel(reads_position_ids=False), 16, 32)
    assert refuse_position_blind(_MadeUpModel(reads_position_ids=True), 16, 32) is None


def test_bart_s_decoder_is_refused_and_rope_and_learned_positions_pass():
    bart = _tiny("bart")
    training = [m.training for m in bart.modules()]
    with pytest.raises(ValueError, match=r"BartLearnedPositionalEmbedding \(at model.decoder.embed_positions\)"):
        refuse_position_blind(bart, 16, 128)
    assert [m.training for m in bart.modules()] == training  # each module's mode back as it was
    for family in ("llama", "gpt2", "bert"):  # rotary from position_ids; learned tables indexed by them
        assert refuse_position_blind(_tiny(family), 16, 128) is None, family
