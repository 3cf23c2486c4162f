"""``torch.compile(fullgraph=True)`` holds ds_ring's attention whole, and the compiled step equals eager.

ds_ring's own entry points (``sequence_parallel_attention``, ``ring_dilated_attention``, ``RingDilatedAttention``):
float64 shards on 2 gloo ranks (4 for hybrid, slow), ``backend="aot_eager"``, no graph break, the output, the LSE and
every input's gradient equal to the eager call's, and the ``"attention"`` events of a compiled step the eager step's
(no second forward event from the backward's recompute). About 30 s on 2 ranks.

A tiny float64 Llama (GQA) and Mistral (a 20-token sliding window on every layer), one layer each, registered with
ds_ring: on 4 gloo ranks with ring (contiguous and zigzag), Ulysses and hybrid 2 × 2, plain and packed batches
(documents crossing shard boundaries), ``backend="aot_eager"``: no graph break (``torch._dynamo.utils.counters``),
and the logits and every parameter gradient equal the eager step's. On 2 ranks: ``backend="inductor"``, and a
DeepSpeed engine's ``engine.compile()``. Slow: about 6 minutes in all at a load of 6-8. Where
the model without ds_ring does not compile whole (torch 2.6 with transformers 5.0: 2 graph breaks in transformers'
own code), the compiled model must break exactly as often (ds_ring adds none), without ``fullgraph``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_ring.integrations.hf import causal_lm_loss, register_with_transformers, shard_batch
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.hf_cases import VOCAB, ds_config, full_batch, llama, topology_for

DOCUMENTS, OTHER_DOCUMENTS = [0, 11, 20, 32], ([0, 5, 23, 32], [0, 16, 29, 32], [0, 9, 27, 32])
CASES_4 = [  # (model, strategy section, packed)
    ("llama", {"strategy": "ring"}, False),
    ("llama", {"strategy": "ring", "layout": "zigzag"}, True),
    ("llama", {"strategy": "ulysses"}, True),
    ("llama", {"strategy": "hybrid", "ulysses_degree": 2, "ring_degree": 2}, False),
    ("mistral", {"strategy": "hybrid", "ulysses_degree": 2, "ring_degree": 2, "layout": "zigzag"}, True),
    ("mistral", {"strategy": "ring"}, False),
]


def _model(name: str) -> torch.nn.Module:
    if name == "llama":
        return llama(num_hidden_layers=1)  # float64
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, use_cache=False, sliding_window=20,
        attn_implementation="sdpa",
    )  # fmt: skip
    return MistralForCausalLM(config).double()


def _batch(packed: bool, documents: list[int] = DOCUMENTS) -> dict[str, torch.Tensor]:
    batch = full_batch()
    if packed:
        positions = torch.cat([torch.arange(b - a) for a, b in zip(documents[:-1], documents[1:], strict=True)])
        batch["position_ids"] = positions.expand(batch["input_ids"].shape[0], -1)
    return batch


def _step(model: Any, params: torch.nn.Module, session: Any, sharded: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of this rank's shard and every parameter's gradient of the sequence-parallel loss."""
    params.zero_grad()
    logits = model(**{k: v for k, v in sharded.items() if k != "shift_labels"}).logits
    causal_lm_loss(session, logits, sharded["shift_labels"]).backward()
    return logits.detach(), [p.grad.detach().clone() for p in params.parameters()]


def _compare(log: CaseLog, name: str, eager: tuple, got: tuple) -> None:
    pairs = zip(got[1], eager[1], strict=True)
    worst = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in pairs)
    logits = (got[0] - eager[0]).abs().max().item()
    print(f"rank {torch.distributed.get_rank()} {name}: logits max |diff| {logits:.2e}, gradients max |diff| / "
          f"max |grad| {worst:.2e}", flush=True)  # the numbers docs/hf.md shows  # fmt: skip
    with log.case(f"{name}: logits"):
        torch.testing.assert_close(got[0], eager[0])  # the dtype's default tolerance (float64: 1e-7)
    with log.case(f"{name}: gradients"):
        for a, b in zip(got[1], eager[1], strict=True):
            torch.testing.assert_close(a, b)


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _model_own_breaks(model_name: str, backend: str) -> int:
    """The graph breaks of the model without ds_ring, one whole-batch step: 0 on torch 2.13; on torch 2.6 with
    transformers 5.0, 2 (transformers' own ``check_model_inputs`` reads ``co_varnames``, which 2.6 does not trace).
    ds_ring's attention must add none: where the model compiles whole, ``fullgraph=True`` holds."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model(model_name)
    torch.compile(model, backend=backend)(**{k: v for k, v in full_batch().items() if k != "labels"}).logits.sum()
    own = _breaks()
    torch._dynamo.reset()
    counters.clear()
    return own


def _compiled_cases(rank: int, world: int, cases: list, backend: str) -> list[str]:
    import torch._dynamo

    log, topologies = CaseLog(), {}
    for model_name, section, packed in cases:
        name = f"{model_name} {section} packed={packed} {backend}"
        with log.case(name):
            own = _model_own_breaks(model_name, backend)  # before registering: ds_ring serves every model after
            model = _model(model_name)
            session = register_with_transformers(
                model, config=ds_config(**section), topology=topology_for(section, world, topologies)
            )
            try:
                sharded = shard_batch(session, _batch(packed))
                eager = _step(model, model, session, sharded)
                torch._dynamo.reset()
                from torch._dynamo.utils import counters

                counters.clear()
                compiled = torch.compile(model, backend=backend, fullgraph=own == 0)
                graphs = None
                for _ in range(2):  # the second step runs the compiled graph without tracing
                    got = _step(compiled, model, session, sharded)
                    assert _breaks() == own, f"graph breaks: {dict(counters['graph_break'])}, the model's own: {own}"
                    graphs = _graphs() if graphs is None else graphs
                    assert _graphs() == graphs, "the second step compiled again (a guard on ds_ring's state failed)"
                    _compare(log, name, eager, got)
                if packed:  # other documents: equal to eager (a new set may still compile a new graph)
                    for documents in OTHER_DOCUMENTS:
                        other = shard_batch(session, _batch(True, documents))
                        _compare(log, f"{name}, documents {documents}", _step(model, model, session, other),
                                 _step(compiled, model, session, other))  # fmt: skip
            finally:
                session.close()
    return log.failures


@pytest.mark.slow  # 202 s at load 6-8 (37 min while every compiled step compiled again)
def test_compiled_model_equals_eager_without_graph_breaks_on_4_ranks():
    assert_no_failures(run_distributed(_compiled_cases, 4, timeout=1800, cases=CASES_4, backend="aot_eager"))


@pytest.mark.slow  # 100 s at load 6-8
@pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 7),
    reason="torch 2.6's inductor gets this Llama's gradients wrong without ds_ring too (docs/hf.md)",
)
def test_inductor_on_2_ranks():
    cases = [("llama", {"strategy": "ring"}, True), ("llama", {"strategy": "ulysses"}, False)]
    assert_no_failures(run_distributed(_compiled_cases, 2, timeout=1800, cases=cases, backend="inductor"))


def _engine_rank(rank: int, world: int) -> list[str]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import ds_ring
    from tests.hf_cases import sgd

    log = CaseLog()
    config = {
        **ds_config(strategy="ulysses"), "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
    }  # fmt: skip
    results, own = [], _model_own_breaks("llama", "aot_eager")
    for compiled in (False, True):
        model = llama(torch.float32, num_hidden_layers=1)
        engine, *_ = ds_ring.initialize(model=model, config=config, optimizer=sgd(model))
        session = register_with_transformers(model, config=config, topology=engine.mpu)
        try:
            if compiled:
                torch._dynamo.reset()
                counters.clear()
                engine.compile(backend="aot_eager", compile_kwargs={"fullgraph": own == 0})
            sharded = shard_batch(session, _batch(True))
            inputs = {k: v for k, v in sharded.items() if k != "shift_labels"}
            graphs = None
            for _ in range(2):
                logits = engine(**inputs).logits
                engine.backward(causal_lm_loss(session, logits, sharded["shift_labels"]))
                engine.step()
                graphs = _graphs() if graphs is None else graphs
            if compiled:
                with log.case("engine.compile(): the second step compiles nothing"):
                    assert _graphs() == graphs
            results.append((logits.detach(), [p.detach().clone() for p in engine.module.parameters()]))
        finally:
            session.close()
            engine.destroy()
    with log.case("engine.compile(): no graph break but the model's own"):
        assert _breaks() == own, (dict(counters["graph_break"]), own)
    _compare(log, "engine.compile() (logits, then parameters after 2 steps)", results[0], results[1])
    return log.failures


@pytest.mark.slow
def test_deepspeed_engine_compile_on_2_ranks():
    assert_no_failures(run_distributed(_engine_rank, 2, timeout=1800))


def _function_cases(topology: Any, world: int, seq: int) -> list[tuple[str, Any]]:
    """(name, ``f(q, k, v, sinks) -> out or (out, lse)``) over ds_ring's entry points."""
    import ds_ring

    spa, rda = ds_ring.sequence_parallel_attention, ds_ring.ring_dilated_attention
    if world == 4:
        return [
            ("hybrid 2x2 causal packed", lambda q, k, v, s: spa(
                q, k, v, causal=True, topology=topology, strategy="hybrid", cu_seqlens=[0, 7, 20, seq])),
            ("hybrid 2x2 zigzag, tensor documents, lse", lambda q, k, v, s: spa(
                q, k, v, causal=True, topology=topology, strategy="hybrid", layout="zigzag",
                cu_seqlens=torch.tensor([0, 11, seq]), return_lse=True)),
        ]  # fmt: skip
    module = ds_ring.RingDilatedAttention(causal=True, topology=topology, strategy="ulysses", window=9)
    torch.manual_seed(2)  # the same weights on every rank
    projected = ds_ring.MultiheadRingDilatedAttention(
        32, 4, 2, topology=topology, strategy="ring", causal=True, dtype=torch.float64
    )
    return [
        ("ring causal", lambda q, k, v, s: spa(q, k, v, causal=True, topology=topology, strategy="ring")),
        ("ring zigzag causal packed, sinks", lambda q, k, v, s: spa(
            q, k, v, causal=True, topology=topology, strategy="ring", layout="zigzag", cu_seqlens=[0, 5, 21, seq],
            sinks=s)),
        ("ulysses, tensor documents, lse", lambda q, k, v, s: spa(
            q, k, v, topology=topology, strategy="ulysses", cu_seqlens=torch.tensor([0, 9, seq]), return_lse=True)),
        ("ring_dilated_attention dilated, lse", lambda q, k, v, s: rda(q, k, v, [8, seq], [1, 2], return_lse=True)),
        ("RingDilatedAttention ulysses window, sinks", lambda q, k, v, s: module(q, k, v, sinks=s)),
        ("MultiheadRingDilatedAttention ring causal", lambda q, k, v, s: projected(q.flatten(2))[0]
            + 0 * (k.sum() + v.sum())),  # k, v: unused, given gradients to compare
    ]  # fmt: skip


def _functions_rank(rank: int, world: int) -> list[str]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import ds_ring

    log = CaseLog()
    topology = ds_ring.Topology(1, 2, 2) if world == 4 else ds_ring.Topology(1, 1, world)
    torch.manual_seed(0)
    batch, seq, heads, kv_heads, dim = 2, 16 * world, 4, 2, 8
    whole = [torch.randn(batch, seq, h, dim, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]
    sinks = torch.randn(heads, dtype=torch.float64, requires_grad=True)
    events: list[str] = []

    def listen(event: Any) -> None:
        if event.kind == "attention":
            events.append(f"{event.extra.get('direction')} {event.phase}")

    def step(f: Any, layout: str) -> tuple[list[torch.Tensor], list[str]]:
        shards = [ds_ring.shard_sequence(x, topology, layout=layout).requires_grad_(True) for x in whole]
        sinks.grad = None
        events.clear()
        got = f(*shards, sinks)
        outs = list(got) if isinstance(got, tuple) else [got]
        sum((o.double() * torch.randn_like(o, dtype=torch.float64)).sum() for o in outs).backward()
        grads = [x.grad for x in shards] + ([sinks.grad.clone()] if sinks.grad is not None else [])
        return [o.detach() for o in outs] + grads, list(events)

    with ds_ring.register_hook(listen):
        for name, f in _function_cases(topology, world, seq):
            layout = "zigzag" if "zigzag" in name else "contiguous"
            with log.case(name):
                torch.manual_seed(1)
                eager, eager_events = step(f, layout)
                torch._dynamo.reset()
                counters.clear()
                compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
                for _ in range(2):  # the second runs the compiled graph without tracing
                    torch.manual_seed(1)
                    got, got_events = step(compiled, layout)
                    assert _breaks() == 0, dict(counters["graph_break"])
                    assert len(got) == len(eager)
                    for a, b in zip(got, eager, strict=True):
                        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
                    assert got_events == eager_events, (got_events, eager_events)  # once per step, as eager
    return log.failures


def test_entry_points_compile_whole_and_equal_eager_on_2_ranks():
    assert_no_failures(run_distributed(_functions_rank, 2, timeout=600))


@pytest.mark.slow  # 4 ranks compiling on 2 cores
def test_hybrid_entry_point_compiles_whole_on_4_ranks():
    assert_no_failures(run_distributed(_functions_rank, 4, timeout=900))
