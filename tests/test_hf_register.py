"""Registration, refusals and batches of ``ds_ring.integrations.hf`` on 2 gloo ranks.

- register → unregister leaves transformers' attention and mask registries exactly as they were
  (also over an entry someone else replaced first, as ALST does); a refused registration changes nothing;
- every refusal raises a ValueError naming the field on every rank, before any communication:
  eager, a padding mask, logit soft-capping, attention dropout in training, K/V heads that do not divide the heads,
  heads the strategy cannot split, missing position_ids / cu_seq_lens_q, a length that does not
  split, rows packed differently, a topology of other degrees;
- ``pad_to_multiple`` pads with label -100 and keeps the whole model's loss; ``disable_in_eval``
  runs the original attention on whole sequences in eval; ``shard_batch`` makes global zigzag
  positions and labels shifted before sharding; ``SequenceParallelDataLoader`` keeps ``len()``.
"""

import re

import pytest
import torch
import torch.nn.functional as F

import ds_ring
from ds_ring.integrations.hf import (
    SequenceParallelDataLoader,
    causal_lm_loss,
    register_with_transformers,
    shard_batch,
)
from tests.dist import CaseLog, run_distributed
from tests.hf_cases import SEQ, VOCAB, assert_same, ds_config, full_batch, llama, sequence_parallel, whole_model


def _registries() -> list[dict]:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    return [
        dict(mapping)
        for mapping in (
            ALL_ATTENTION_FUNCTIONS._local_mapping,
            AttentionInterface._global_mapping,
            ALL_MASK_ATTENTION_FUNCTIONS._local_mapping,
            AttentionMaskInterface._global_mapping,
        )
    ]


def _refused(log: CaseLog, name: str, match: str, call) -> None:
    """``call()`` must raise a ValueError matching ``match`` and leave the registries as they were."""
    with log.case(f"refuses {name}"):
        before = _registries()
        try:
            call()
        except ValueError as err:
            assert re.search(match, str(err)), f"the ValueError does not name {match!r}: {err}"
        else:
            raise AssertionError("no ValueError")
        assert _registries() == before, "a refused call changed transformers' registries"


def _check_registry(log: CaseLog, topology: ds_ring.Topology) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with log.case("register -> unregister restores the registries"):
        before = _registries()
        first = register_with_transformers(config=ds_config(strategy="ring"), topology=topology)
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is first.attention and first.installed
        second = register_with_transformers(config=ds_config(strategy="ring"), topology=topology, disable_in_eval=True)
        assert not first.installed and second.installed, "a second registration replaces the first"
        third = register_with_transformers(core_attn_implementation="flash_attention_2", topology=topology)
        third.close()
        third.close()
        assert _registries() == before
    with log.case("a session is a context manager; each call reads its own session, never another's"):
        before = _registries()
        with register_with_transformers(config=ds_config(strategy="ring", layout="zigzag"), topology=topology) as zig:
            assert zig.installed
        assert _registries() == before and not zig.installed
        with register_with_transformers(config=ds_config(strategy="ring"), topology=topology) as plain:
            got, want = shard_batch(zig, full_batch()), shard_batch(plain, full_batch())
            assert not torch.equal(got["position_ids"], want["position_ids"]), "the zigzag session's layout was lost"
        assert _registries() == before
    with log.case("a Topology where the session goes: TypeError naming the fix"):
        with pytest.raises(TypeError, match="session = register_with_transformers"):
            shard_batch(topology, full_batch())  # the call of older releases
        with pytest.raises(TypeError, match="causal_lm_loss takes the SequenceParallelSession"):
            causal_lm_loss(topology, torch.zeros(1, 2, VOCAB), torch.zeros(1, 2, dtype=torch.long))
    with log.case("an entry replaced before (ALST-style) is put back"):

        def alst(*args, **kwargs):  # a stand-in for ALST's wrapper
            raise AssertionError("not called")

        ALL_ATTENTION_FUNCTIONS["sdpa"] = alst
        before = _registries()
        session = register_with_transformers(topology=topology)
        session.close()
        assert _registries() == before and ALL_ATTENTION_FUNCTIONS["sdpa"] is alst
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


def _check_refusals(log: CaseLog, world: int, topology: ds_ring.Topology) -> None:
    from transformers import LlamaConfig, Qwen2Config

    ring = ds_config(strategy="ring")
    batch = full_batch()
    small = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1}
    softcapped = LlamaConfig(**small, num_attention_heads=4)
    softcapped.attn_logit_softcapping = 30.0
    three_heads = LlamaConfig(**small, num_attention_heads=3)
    ulysses = ds_config(strategy="ulysses")
    with register_with_transformers(config=ring, topology=topology) as session:  # closed: shard_batch reads it only
        pass
    # at registration, from the model's config
    _refused(log, "eager", "eager", lambda: register_with_transformers(core_attn_implementation="eager", config=ring))
    _refused(log, "unknown implementation", "not one of", lambda: register_with_transformers(
        core_attn_implementation="sdpa2", config=ring))  # fmt: skip
    _refused(log, "a model built eager", "_attn_implementation", lambda: register_with_transformers(
        llama(attn_implementation="eager"), config=ring, topology=topology))  # fmt: skip
    with log.case("soft-capped attention is registered (computed, not refused)"):
        session = register_with_transformers(softcapped, config=ring, topology=topology)
        session.close()
    three_kv_heads = Qwen2Config(**small, num_attention_heads=4, num_key_value_heads=3)
    _refused(log, "K/V heads (config)", "num_key_value_heads", lambda: register_with_transformers(
        three_kv_heads, config=ring, topology=topology))  # fmt: skip
    _refused(log, "heads (config)", "num_attention_heads = 3", lambda: register_with_transformers(
        three_heads, config=ulysses, topology=topology))  # fmt: skip
    _refused(log, "other degrees", "topology has", lambda: register_with_transformers(
        config=ds_config(strategy="ring", sequence_parallel_size=1), topology=topology))  # fmt: skip
    _refused(log, "the section alone", "whole ds_config", lambda: register_with_transformers(
        config={"strategy": "ring"}, topology=topology))  # fmt: skip
    # in the batch
    _refused(log, "padding mask (batch)", "attention_mask", lambda: shard_batch(session,
        {**batch, "attention_mask": (torch.arange(SEQ) < SEQ - 3).expand(2, -1)}))  # fmt: skip
    _refused(log, "a length that does not split", f"multiple of {world}", lambda: shard_batch(session,
        full_batch(SEQ - 1)))  # fmt: skip
    _refused(log, "positions not counting up", "count 0, 1, 2", lambda: shard_batch(session,
        {**batch, "position_ids": torch.arange(SEQ).flip(0)[None]}))  # fmt: skip
    packed = torch.stack([torch.cat([torch.arange(10), torch.arange(SEQ - 10)]), torch.arange(SEQ)])
    _refused(log, "rows packed differently", "same places", lambda: shard_batch(session,
        {**batch, "position_ids": packed}))  # fmt: skip
    _refused(log, "a tensor of another length", "labels", lambda: shard_batch(session,
        {**batch, "labels": batch["labels"][:, :-1]}))  # fmt: skip

    # at the call, on every rank before any communication
    def forward(model, config, drop=(), **extra):
        session = register_with_transformers(config=config, topology=topology)
        try:
            sharded = shard_batch(session, batch)
            inputs = {k: v for k, v in sharded.items() if k != "shift_labels" and k not in drop}
            return model(**inputs, **extra)
        finally:
            session.close()

    _refused(log, "attention dropout in training", "attention_dropout", lambda: forward(
        llama(attention_dropout=0.1).train(), ring))  # fmt: skip
    _refused(log, "heads (call)", "num_attention_heads = 3", lambda: forward(
        llama(hidden_size=48, num_attention_heads=3, num_key_value_heads=3), ulysses))  # fmt: skip
    zigzag_ring = ds_config(strategy="ring", layout="zigzag")
    _refused(log, "missing position_ids", "position_ids", lambda: forward(
        llama(), zigzag_ring, drop=("position_ids",)))  # fmt: skip
    _refused(log, "missing cu_seq_lens_q", "cu_seq_lens_q", lambda: forward(
        llama(), ring, drop=("cu_seq_lens_q", "cu_seq_lens_k", "ds_ring_cu_seqlens")))  # fmt: skip
    _refused(log, "padding mask (call)", "attention_mask", lambda: forward(
        llama(), ring, attention_mask=torch.zeros(2, SEQ // world, dtype=torch.long)))  # fmt: skip
    _refused(log, "long_context never applied to the model", "session.apply_long_context", lambda: forward(
        llama(), ds_config(strategy="ring", long_context={"tiled_loss": True})))  # fmt: skip
    with log.case("attention dropout is allowed in eval"):
        model = llama(attention_dropout=0.1).eval()
        session = register_with_transformers(config=ring, topology=topology)
        try:
            sharded = shard_batch(session, batch)
            model(**{k: v for k, v in sharded.items() if k != "shift_labels"})
        finally:
            session.close()


def _check_batches(log: CaseLog, rank: int, world: int, topology: ds_ring.Topology) -> None:
    batch = full_batch()
    with log.case("shard_batch: zigzag positions, labels shifted before sharding, one document"):
        session = register_with_transformers(config=ds_config(strategy="ring", layout="zigzag"), topology=topology)
        try:
            sharded = shard_batch(session, batch)
        finally:
            session.close()
        chunk = SEQ // (2 * world)
        tokens = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * world - 1 - rank)])
        assert torch.equal(sharded["position_ids"], tokens.expand(2, -1))
        assert torch.equal(sharded["input_ids"], batch["input_ids"][:, tokens])
        shifted = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        assert torch.equal(sharded["shift_labels"], shifted[:, tokens])
        assert sharded["cu_seq_lens_q"].tolist() == [0, SEQ] and sharded["cu_seq_lens_q"].dtype == torch.int32
        assert "labels" not in sharded and "attention_mask" not in sharded
    with log.case("pad_to_multiple: pads get label -100; the loss is the whole model's"):
        model = llama()
        short = full_batch(SEQ - 1)
        expected = whole_model(model, short)
        session = register_with_transformers(model, config=ds_config(strategy="ring"), topology=topology)
        try:
            sharded = shard_batch(session, {**short, "attention_mask": torch.ones_like(short["input_ids"])},
                                  pad_to_multiple=True)  # fmt: skip
            assert sharded["input_ids"].shape == (2, SEQ // world)
            assert sharded["cu_seq_lens_q"].tolist() == [0, SEQ]
            logits = model(**{k: v for k, v in sharded.items() if k != "shift_labels"}).logits
            loss = causal_lm_loss(session, logits, sharded["shift_labels"])
        finally:
            session.close()
        if rank == world - 1:
            assert (sharded["shift_labels"][:, -2:] == -100).all()
            assert sharded["position_ids"][0, -1].item() == SEQ - 1
        torch.testing.assert_close(loss, expected.loss.double(), rtol=1e-6, atol=0)
    with log.case("disable_in_eval: eval runs the original attention on the whole sequence"):
        model = llama()
        expected = whole_model(model, batch)
        session = register_with_transformers(
            model, config=ds_config(strategy="ring"), topology=topology, disable_in_eval=True
        )
        try:
            with torch.no_grad():
                logits = model.eval()(input_ids=batch["input_ids"]).logits
            got = sequence_parallel(model.train(), batch, session)
        finally:
            session.close()
        torch.testing.assert_close(logits, expected.logits, rtol=1e-7, atol=1e-9)
        assert_same(got, expected)
    with log.case("SequenceParallelDataLoader: len() kept, shard_batch of each batch"):
        loader = torch.utils.data.DataLoader([full_batch(seed=s) for s in range(3)], batch_size=None)
        wrapped = SequenceParallelDataLoader(loader, session)
        assert len(wrapped) == 3
        for got, full in zip(wrapped, loader, strict=True):
            want = shard_batch(session, full)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
                       for k in want)  # fmt: skip


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    topology = ds_ring.Topology(ring=world)
    _check_registry(log, topology)
    _check_refusals(log, world, topology)
    _check_batches(log, rank, world, topology)
    return log.failures


@pytest.mark.timeout(150)
def test_register_refusals_and_batches():
    results = run_distributed(_rank, 2, timeout=120)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures; first:\n" + "\n".join(failures[:3])
