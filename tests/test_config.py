"""The ds_config section: ready configs load; malformed ones fail at load time naming field and value."""

import json
from pathlib import Path

import pytest

import ds_ring
from ds_ring.config import RingAttentionConfig

CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
WORLD = {"cpu_default.json": 2, "ring_zero2.json": 4, "allgather_zero1.json": 4, "ulysses_zero3.json": 4,
         "hybrid.json": 8, "hf_ring.json": 2, "hf_ulysses.json": 2, "hf_trainer.json": 2,
         "hf_long_context.json": 2, "hf_long_context_world.json": 4,
         "sft_ring.json": 2, "sft_hybrid.json": 2}  # fmt: skip


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_ready_configs_load_and_fit_their_world(name):
    section = ds_ring.load_config(CONFIGS / name)
    assert section.enabled
    data_parallel, ulysses, ring = section.degrees(WORLD[name])
    assert data_parallel * ulysses * ring == WORLD[name]
    section.check(world_size=WORLD[name], num_heads=8, seq_len=2**17)
    assert ds_ring.load_config(json.loads((CONFIGS / name).read_text())) == section


def test_every_ready_config_is_listed():
    assert {p.name for p in CONFIGS.glob("*.json")} == set(WORLD)


def test_missing_section_means_disabled():
    assert ds_ring.load_config({"train_batch_size": 8}).enabled is False


MALFORMED = [
    ({"strategy": "rnig"}, ["strategy", "rnig"]),
    ({"comunication": "ring"}, ["comunication", "did you mean 'communication'"]),
    ({"communication": "p2p"}, ["communication", "p2p"]),
    ({"sequence_parallel_size": 0}, ["sequence_parallel_size", "0"]),
    ({"ulysses_degree": -2, "strategy": "hybrid"}, ["ulysses_degree", "-2"]),
    ({"segment_lengths": [1024, 2048], "dilation_rates": [1]}, ["segment_lengths", "[1024, 2048]"]),
    ({"segment_lengths": [0], "dilation_rates": [1]}, ["segment_lengths", "[0]"]),
    ({"segment_lengths": [1024]}, ["dilation_rates", "None"]),
    ({"layout": "spiral"}, ["layout", "spiral"]),
    ({"layout": "zigzag", "segment_lengths": [8], "dilation_rates": [1]}, ["zigzag", "[8]"]),
    ({"strategy": "allgather", "communication": "ring"}, ["strategy 'allgather'", "communication is 'ring'"]),
    ({"strategy": "ulysses", "communication": "allgather"}, ["strategy 'ulysses'", "no ring dimension"]),
    ({"strategy": "ring", "ulysses_degree": 2}, ["ulysses_degree", "2", "hybrid"]),
    ({"strategy": "ulysses", "ring_degree": 2}, ["ring_degree", "2"]),
    ({"strategy": "hybrid", "ring_degree": 2}, ["hybrid", "ulysses_degree"]),
    ({"strategy": "hybrid", "ulysses_degree": 2, "ring_degree": 2, "sequence_parallel_size": 8},
     ["ulysses_degree 2", "ring_degree 2", "sequence_parallel_size 8"]),
    ({"timeout_s": 0}, ["timeout_s", "0"]),
    ({"timeout_s": "soon"}, ["timeout_s", "soon"]),
    ({"causal": "maybe"}, ["causal", "maybe"]),
    ({"dilation_rates": [1, 2], "segment_lengths": [64, "long"]}, ["segment_lengths", "long"]),
    ({"monitoring": {"numerics_guard": "loud"}}, ["monitoring.numerics_guard", "loud", "skip_step"]),
    ({"monitoring": {"metrix": True}}, ["monitoring", "metrix", "did you mean 'metrics'"]),
    ({"monitoring": {"metrics": "sometimes"}}, ["monitoring.metrics", "sometimes"]),
    ({"monitoring": {"watchdog": None}}, ["monitoring.watchdog", "None"]),
    ({"monitoring": {"step_timeout_s": 0}}, ["monitoring.step_timeout_s", "0"]),
    ({"monitoring": {"step_timeout_s": "later"}}, ["monitoring.step_timeout_s", "later"]),
    ({"monitoring": "all"}, ["monitoring", "all"]),
    ({"monitor": {}}, ["monitor", "did you mean 'monitoring'"]),
]  # fmt: skip


@pytest.mark.parametrize(("section", "needles"), MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_section_rejected_at_load(section, needles):
    with pytest.raises(ValueError) as err:
        ds_ring.load_config({"ring_attention": section})
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_monitoring_defaults_and_ready_values():
    assert ds_ring.load_config({"ring_attention": {}}).monitoring.model_dump() == {
        "metrics": False, "watchdog": True, "step_timeout_s": None, "numerics_guard": "off"
    }  # fmt: skip
    for mode in ("off", "warn", "raise", "skip_step"):
        section = ds_ring.load_config({"ring_attention": {"monitoring": {"numerics_guard": mode, "step_timeout_s": 5}}})
        assert (section.monitoring.numerics_guard, section.monitoring.step_timeout_s) == (mode, 5.0)


def test_metrics_need_a_deepspeed_monitor_before_any_collective():
    from ds_ring.engine.initialize import initialize

    config = {"train_micro_batch_size_per_gpu": 1, "ring_attention": {"monitoring": {"metrics": True}}}
    with pytest.raises(ValueError, match=r"monitoring.metrics is true but the ds_config enables none of .*csv_monitor"):
        initialize(model=ds_ring.RingDilatedAttention(), config=config)


def test_section_must_be_an_object(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"ring_attention": 5}))
    with pytest.raises(ValueError, match="ring_attention must be a JSON object, got 5"):
        ds_ring.load_config(path)


RUN_MISMATCHES = [
    (dict(sequence_parallel_size=4), dict(world_size=6, num_heads=8, seq_len=1024), ["4", "world size 6"]),
    (dict(strategy="ulysses", sequence_parallel_size=4), dict(world_size=4, num_heads=6, seq_len=1024),
     ["6 heads", "multiple of 4", "strategy 'hybrid'"]),
    (dict(sequence_parallel_size=3), dict(world_size=3, num_heads=8, seq_len=1000), ["1000", "divisible by 3"]),
    (dict(sequence_parallel_size=2, layout="zigzag"), dict(world_size=2, num_heads=8, seq_len=1026),
     ["1026", "zigzag"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("section", "run", "needles"), RUN_MISMATCHES, ids=[str(i) for i in range(len(RUN_MISMATCHES))]
)
def test_section_checked_against_the_run(section, run, needles):
    config = RingAttentionConfig(**section)
    with pytest.raises(ValueError) as err:
        config.check(**run)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_segments_may_cross_shards():
    """A segment that neither divides the shard nor is a multiple of it spans the ranks it crosses."""
    RingAttentionConfig(sequence_parallel_size=2, segment_lengths=[300], dilation_rates=[1]).check(
        world_size=2, num_heads=8, seq_len=1024
    )


def test_communication_accepts_a_registered_exchange(monkeypatch):
    """A new exchange is one module plus one register_exchange line: the ds_config can then select it."""
    from ds_ring.strategies import sharded
    from ds_ring.strategies.registry import PLUGINS

    monkeypatch.setitem(PLUGINS.exchanges.entries, "ring_copy", sharded.get_exchange("ring"))
    assert RingAttentionConfig(communication="ring_copy").communication == "ring_copy"


def test_read_section_is_the_one_reader_and_enabled_false_means_no_sequence_parallelism():
    from ds_ring.config import read_section

    default = read_section(None)
    assert default.section == RingAttentionConfig() and default.whole == {} and default.zero_optimization is None
    off = read_section({
        "zero_optimization": {"stage": 2},
        "ring_attention": {"enabled": False, "strategy": "ulysses", "sequence_parallel_size": 4, "layout": "zigzag",
                           "timeout_s": 7, "long_context": {"tiled_loss": True}},
    })  # fmt: skip
    assert not off.section.enabled and off.section.sequence_parallel_size == 1
    assert (off.section.strategy, off.section.layout) == ("ring", "contiguous"), "attention fields dropped"
    assert off.section.timeout_s == 7 and off.section.long_context.tiled_loss, "the rest still applies"
    assert off.zero_optimization == {"stage": 2}
    assert read_section({"train_batch_size": 8}).section == read_section({"ring_attention": {"enabled": False}}).section
    with pytest.raises(ValueError, match="whole ds_config"):
        read_section({"strategy": "ring"})
    read_section({"ring_attention": {"strategy": "ring"}}).agree()  # no process group: nothing to agree with


def test_zero_owns_the_gradient_scale_rule():
    import torch

    from ds_ring.engine.gradient_scale import engine_config, gradient_scale, mark_parameters, parameter_gradient_scale

    assert engine_config({"zero_optimization": {"stage": 3}}, 2)["zero_optimization"]["reduce_scatter"] is False
    assert engine_config({"zero_optimization": {"stage": 3}}, 1) == {"zero_optimization": {"stage": 3}}
    assert (gradient_scale({"stage": 3}, 4), gradient_scale({"stage": 3, "reduce_scatter": False}, 4)) == (4, 1)
    model = torch.nn.Linear(2, 2)
    mark_parameters(model, {"zero_optimization": {"stage": 3}}, 4)
    assert parameter_gradient_scale(model.parameters(), None, 4, where="Linear") == 4
