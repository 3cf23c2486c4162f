"""DeepSpeed ALST's calls, unchanged, on ds_ring: the cases of DeepSpeed's ``test_ulysses_sp_hf.py``.

2 gloo ranks, a tiny random Llama saved to a local directory (loaded by path, as ALST's tests load
``hf-internal-testing/tiny-random-LlamaForCausalLM``; nothing downloads), fp32:

- ALST's tutorial training loop with one import changed (``from ds_ring.integrations.hf import
  UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter``), its ``Adam`` config block (``torch_adam``: no compiled
  op on CPU) and ``model.step()`` after its ``model.backward(loss)``, at ZeRO 2 and 3: the parameters equal
  the whole model trained on the ranks' samples in ALST's order (every rank's sample whole, rank by rank);
- the adapter yields ALST's shards (its test's expected ``input_ids``, ``position_ids``, ``shift_labels``),
  gathers samples of different lengths, keeps ALST's ``len()``, and refuses a wrong ``sp_rank``;
- a PEFT-like wrapper (a ``config`` without ``_attn_implementation``) registers; an implementation that does
  not match the model's raises; a hub kernel name is registered through transformers' lazy kernel import
  (mocked, as DeepSpeed's test does) and its entry replaced, ``sdpa`` untouched; ``disable_in_eval`` runs
  whole sequences in eval exactly; ``flex_attention`` (forward-only on CPU in PyTorch) trains through
  ds_ring equal to the whole model; ``sequence_parallel_size=1`` returns ``None``; ALST's argument checks.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from ds_ring.tiles.zero import gathered
from tests.dist import CaseLog
from tests.hf_cases import (
    BATCH,
    assert_same,
    full_batch,
    launcher_env,
    llama,
    run_on_saved_llama,
    sequence_parallel,
    shifted,
    whole_model,
)

LR = 1e-3


def _tutorial_config(stage: int) -> dict:
    """The tutorial's ds_config (its Adam block with ``torch_adam``), without clipping."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
        "sequence_parallel_size": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def _dataset():
    input_ids = torch.tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    return torch.utils.data.TensorDataset(input_ids, position_ids)


def _collate(batch):
    input_ids, position_ids = batch[0]
    return dict(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), labels=input_ids.unsqueeze(0))


def _tutorial(model_dir: str, stage: int) -> list[torch.Tensor]:
    """ALST's tutorial (docs/_tutorials/ulysses-alst-sequence-parallelism.md), one import changed."""
    import deepspeed
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups
    from transformers import AutoModelForCausalLM

    from ds_ring.integrations.hf import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter  # the one changed import

    micro_batch_size, sequence_parallel_size = 1, 2
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model_dir,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch_size,
        seq_length=64,
        seq_length_is_variable=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model, _, _, _ = deepspeed.initialize(
        config=_tutorial_config(stage), model=model, model_parameters=model.parameters(), mpu=mpu
    )
    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()
    dl = torch.utils.data.DataLoader(_dataset(), batch_size=micro_batch_size, collate_fn=_collate)
    dl = UlyssesSPDataLoaderAdapter(dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size,
                                    device=model.device)  # fmt: skip
    for batch in dl:
        batch = move_to_device(batch, model.device, torch.is_tensor)  # DeepSpeed 0.16 needs the criterion
        outputs = model(**batch)  # the tutorial passes the whole batch, shift_labels included
        shift_labels = batch["shift_labels"]
        loss = model.module.loss_function(
            logits=outputs.logits, labels=None, shift_labels=shift_labels, vocab_size=model.module.config.vocab_size
        )
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
        total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(sp_world_size))
        total_good_tokens = sum(good_tokens_per_rank)
        loss = total_loss / max(total_good_tokens, 1)
        model.backward(loss)
        model.step()  # the tutorial's loop shows the backward only
    UlyssesSPAttentionHF.unregister_from_transformers("sdpa")
    params = list(model.module.parameters())
    with gathered(params):
        got = [copy.deepcopy(p.detach()) for p in params]
    model.destroy()
    return got


def _whole_model_in_alst_order(model_dir: str, loss_factor: float = 1.0) -> list[torch.Tensor]:
    """One process: every rank's sample whole, rank by rank (both ranks load the same loader: 0, 0, 1, 1);
    the loss times ``loss_factor``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for sample in [0, 0, 1, 1]:
        batch = _collate([_dataset()[sample]])
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), shifted(batch["labels"]).flatten(), ignore_index=-100)
        loss = loss * loss_factor
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _check_tutorial(log: CaseLog, model_dir: str) -> None:
    """The tutorial's loss (its all_gather's backward sums the replicated loss: each rank back-propagates
    sp × its share) is right under ZeRO 3's division by every rank; at ZeRO 0-2 ALST trains with sp × the
    gradient (DeepSpeed #5248: the whole model trained on 2 × its loss). ds_ring's ``loss_function`` scales
    the shard loss's gradient by 1/sp there (``ds_ring.integrations.hf.loss.shard_loss``): the whole model's
    parameters at both stages. The ZeRO 2 case with factor 2 shows the comparison tells the two apart."""
    doubled = _whole_model_in_alst_order(model_dir, 2.0)
    for stage in (2, 3):
        with log.case(f"ALST's tutorial, one import changed, ZeRO {stage} = the whole model"):
            got = _tutorial(model_dir, stage)
            for param, want in zip(got, _whole_model_in_alst_order(model_dir), strict=True):
                torch.testing.assert_close(param, want, rtol=1e-4, atol=5e-6)
            far = max(float((param - bad).abs().max()) for param, bad in zip(got, doubled, strict=True))
            assert far > 5e-5, f"the comparison cannot tell ALST's 2x gradient apart ({far:.1e})"


def _check_adapter(log: CaseLog, rank: int, model_dir: str) -> None:
    from ds_ring.integrations.hf import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    mpu = UlyssesSPAttentionHF.register_with_transformers(model_dir, "sdpa", 2, 1)
    group = mpu.get_sequence_parallel_group()
    try:
        with log.case("the adapter yields ALST's shards, rank 0's sample then rank 1's, len() = ALST's"):
            dl = torch.utils.data.DataLoader(_dataset(), batch_size=1, collate_fn=_collate)
            adapter = UlyssesSPDataLoaderAdapter(dl, sp_rank=rank, sp_group=group, sp_world_size=2, device="cpu")
            assert len(adapter) == 4
            first = next(iter(adapter))
            expected = [  # DeepSpeed's test_ulysses_sp_hf.py
                {"input_ids": [[1, 10, 10]], "position_ids": [[0, 1, 2]], "shift_labels": [[10, 10, 10]]},
                {"input_ids": [[10, 2, 2]], "position_ids": [[3, 4, 5]], "shift_labels": [[2, 2, -100]]},
            ][rank]
            assert {k: v.tolist() for k, v in first.items()} == expected  # ALST's keys, nothing more
        with log.case("the adapter gathers samples of different lengths and runs each whole, in rank order"):
            own = full_batch(seq=8 if rank == 0 else 12, seed=rank)
            got = list(UlyssesSPDataLoaderAdapter([own], sp_rank=rank, sp_group=group, sp_world_size=2, device="cpu"))
            assert [tuple(b["input_ids"].shape) for b in got] == [(2, 4), (2, 6)]
            sample = full_batch(seq=12, seed=1)["input_ids"]
            assert torch.equal(got[1]["input_ids"], sample[:, rank * 6 : (rank + 1) * 6])
        refused = pytest.raises(ValueError, match=f"sp_rank {1 - rank} / sp_world_size 2")
        with log.case("the adapter refuses an sp_rank that is not this rank's"), refused:
            UlyssesSPDataLoaderAdapter([], sp_rank=1 - rank, sp_group=group, sp_world_size=2, device="cpu")
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers()


class _PeftLike:
    """What ALST's PEFT test passes: an object with a ``config`` and no ``PreTrainedModel`` base."""

    def __init__(self, config) -> None:
        self.config = config


def _check_registration_cases(log: CaseLog, model_dir: str) -> None:
    from transformers import AutoConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_ring.integrations.hf import UlyssesSPAttentionHF

    with log.case("a PEFT-like wrapper (config._attn_implementation None) registers"):
        config = AutoConfig.from_pretrained(model_dir)
        config._attn_implementation = None
        mpu = UlyssesSPAttentionHF.register_with_transformers(_PeftLike(config), "sdpa", 2, 1, 64)
        assert mpu.get_sequence_parallel_world_size() == 2 and mpu.get_sequence_parallel_group() is not None
        UlyssesSPAttentionHF.unregister_from_transformers()
    with log.case("an implementation that does not match the model's raises"):
        config = AutoConfig.from_pretrained(model_dir)
        config._attn_implementation = "sdpa"
        with pytest.raises(ValueError, match="does not match"):
            UlyssesSPAttentionHF.register_with_transformers(_PeftLike(config), "flash_attention_2", 2, 1, 64)
    with log.case("sequence_parallel_size 1 registers nothing; ALST's argument checks"):
        before = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert UlyssesSPAttentionHF.register_with_transformers(model_dir, "sdpa", 1, 1) is None
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
        with pytest.raises(ValueError, match="needs seq_length"):
            UlyssesSPAttentionHF.register_with_transformers(model_dir, "sdpa", 2, 1, seq_length_is_variable=False)
        with pytest.raises(ValueError, match="not divisible by sequence_parallel_size 2"):
            UlyssesSPAttentionHF.register_with_transformers(model_dir, "sdpa", 2, 1, seq_length=63)
        with pytest.raises(ValueError, match="eager"):
            UlyssesSPAttentionHF.register_with_transformers(model_dir, "eager", 2, 1)


def _check_hub_kernel(log: CaseLog, model_dir: str) -> None:
    import transformers.modeling_flash_attention_utils as flash_utils
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_ring.integrations.hf import UlyssesSPAttentionHF

    hub = "kernels-community/flash-attn2"
    called = []

    def lazy_import(implementation, attention_wrapper=None, allow_all_kernels=False):
        # What transformers does for a hub kernel, without the hub: register its attention and mask.
        called.append(implementation)
        ALL_ATTENTION_FUNCTIONS.register(implementation, ALL_ATTENTION_FUNCTIONS["sdpa"])
        ALL_MASK_ATTENTION_FUNCTIONS.register(implementation, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        return (None, None, None, None, None), (None, None)

    real, flash_utils.lazy_import_flash_attention = flash_utils.lazy_import_flash_attention, lazy_import
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        with log.case("a hub kernel name is registered through transformers, then replaced; sdpa untouched"):
            UlyssesSPAttentionHF.register_with_transformers(model_dir, hub, 2, 1, 64)
            assert called == [hub]
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa and ALL_ATTENTION_FUNCTIONS[hub] is not sdpa
            UlyssesSPAttentionHF.unregister_from_transformers(hub)
            assert ALL_ATTENTION_FUNCTIONS[hub] is sdpa  # transformers' own entry is put back
    finally:
        flash_utils.lazy_import_flash_attention = real
        for registry in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):
            registry._global_mapping.pop(hub, None)
            registry._local_mapping.pop(hub, None)


def _check_eval_and_flex(log: CaseLog, model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from ds_ring.integrations.hf import UlyssesSPAttentionHF
    from ds_ring.integrations.hf.session import installed_sessions

    batch = {"input_ids": torch.tensor([[1, 10, 10, 10, 2, 2]]), "position_ids": torch.arange(6)[None]}
    with log.case("disable_in_eval: eval on whole sequences equals the model without ds_ring"):
        baseline = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            want = baseline(**batch).logits
        mpu = UlyssesSPAttentionHF.register_with_transformers(model_dir, "sdpa", 2, 1, 64, disable_in_eval=True)
        try:
            with torch.no_grad():
                got = AutoModelForCausalLM.from_pretrained(model_dir).eval()(**batch).logits
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()
        assert mpu is not None and torch.equal(got, want)
    with log.case("flex_attention (forward-only on CPU in PyTorch) trains through ds_ring = the whole model"):
        model = llama(attn_implementation="flex_attention")
        reference = whole_model(model, full_batch())  # sdpa: the same attention, with a backward on CPU
        model.set_attn_implementation("flex_attention")
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "flex_attention", 2, BATCH)
        try:
            (session,) = installed_sessions()  # what ALST's call installed (its mpu is session.topology)
            assert session.topology is mpu
            got = sequence_parallel(model, full_batch(), session)
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()
        assert_same(got, reference)


def _rank(rank: int, world: int, model_dir: str) -> list[str]:
    launcher_env(rank, world)
    log = CaseLog()
    _check_tutorial(log, model_dir)
    _check_adapter(log, rank, model_dir)
    _check_registration_cases(log, model_dir)
    _check_hub_kernel(log, model_dir)
    _check_eval_and_flex(log, model_dir)
    return log.failures


@pytest.mark.timeout(300)
def test_alst_calls_unchanged():
    run_on_saved_llama(_rank, timeout=240)
