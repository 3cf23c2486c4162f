"""Mixture-of-experts load-balancing loss over the sequence group equals the whole model's.

A tiny float64 Mixtral (4 experts, top 2) with ``output_router_logits``: on 2 and 3 ranks, ring, the load-balancing
loss from each rank's shard of router logits (:func:`router_aux_loss`) equals transformers'
``load_balancing_loss_func`` of the whole model's, and ``causal_lm_loss + coef × aux`` has the whole model's
gradient (summed over the group) — where a per-shard aux loss (what the model computes itself) does not.
transformers computes the router softmax in float32, so equality is to float32 precision.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist import CaseLog, run_distributed


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.5, use_cache=False, attn_implementation="sdpa", experts_implementation="eager",
    )  # fmt: skip
    return MixtralForCausalLM(config).double()


def _rank(rank: int, world: int) -> list[str]:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    import ds_ring
    from ds_ring.integrations.hf import causal_lm_loss, register_with_transformers, shard_batch
    from ds_ring.integrations.hf.router import add_router_aux_loss, router_aux_loss

    log = CaseLog()
    model = _mixtral()
    input_ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=input_ids)
    labels = F.pad(input_ids, (0, 1), value=-100)[:, 1:]
    whole_aux = load_balancing_loss_func(out.router_logits, 4, 2)
    whole = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) + 0.5 * whole_aux
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    topology = ds_ring.Topology(1, 1, world)
    session = register_with_transformers(model, config={"ring_attention": {"timeout_s": 60}}, topology=topology)
    try:
        sharded = shard_batch(session, {"input_ids": input_ids})
        model.zero_grad()
        out = model(**{k: v for k, v in sharded.items() if k != "shift_labels"})
        with log.case("aux loss equals the whole model's"):
            aux = router_aux_loss(out.router_logits, 4, 2, topology)
            torch.testing.assert_close(aux, whole_aux, rtol=1e-7, atol=0, check_dtype=False)
        with log.case("a shard's own aux loss differs (what the model computes alone)"):
            assert not torch.allclose(out.aux_loss, whole_aux, rtol=1e-6)
        with log.case("loss and gradients equal the whole model's"):
            loss = add_router_aux_loss(
                session, causal_lm_loss(session, out.logits, sharded["shift_labels"]), out, model
            )
            torch.testing.assert_close(loss, whole.detach(), rtol=1e-7, atol=0)
            loss.backward()
            for name, param in model.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(
                    grad, expected[name], rtol=1e-6, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}"
                )
    finally:
        session.close()
    return log.failures


@pytest.mark.parametrize("world", [2, 3])
def test_router_aux_loss_over_the_group_equals_the_whole_model(world):
    failures = [f for per_rank in run_distributed(_rank, world, timeout=120) for f in per_rank]
    assert not failures, "\n".join(failures[:2])
