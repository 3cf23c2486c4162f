"""ds_configs in YAML: read like JSON wherever a ds_config path is taken, with the same validation."""

import json
from pathlib import Path

import pytest

import ds_ring
from ds_ring.config import read_ds_config
from launch.train import ds_config_for

CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"


def test_the_yaml_example_is_its_json_twin():
    assert read_ds_config(CONFIGS / "cpu_default.yaml") == json.loads((CONFIGS / "cpu_default.json").read_text())
    assert ds_ring.load_config(CONFIGS / "cpu_default.yaml") == ds_ring.load_config(CONFIGS / "cpu_default.json")


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".YAML"])
def test_yaml_suffixes(tmp_path, suffix):
    path = tmp_path / f"ds_config{suffix}"
    path.write_text("ring_attention:\n  strategy: allgather\n  sequence_parallel_size: 2\n")
    section = ds_ring.load_config(path)
    assert (section.strategy, section.sequence_parallel_size) == ("allgather", 2)


def test_yaml_gets_the_same_validation(tmp_path):
    path = tmp_path / "ds_config.yaml"
    path.write_text("ring_attention:\n  comunication: ring\n")
    with pytest.raises(ValueError, match="comunication.*did you mean 'communication'"):
        ds_ring.load_config(path)
    path.write_text("ring_attention: 5\n")
    with pytest.raises(ValueError, match="ring_attention must be a JSON object, got 5"):
        ds_ring.load_config(path)


SYNTAX_ERRORS = [
    ("ds_config.yaml", "ring_attention:\n  causal: on\n   layout: x\n", "YAML syntax error at line 3, column 10"),
    ("ds_config.yml", "ring_attention:\n  segment_lengths: [1, 2\n", "YAML syntax error at line 3, column 1"),
    ("ds_config.json", '{"ring_attention": {\n  "strategy": "ring",\n}}', "JSON syntax error at line 3, column 1"),
]


@pytest.mark.parametrize(("name", "text", "needle"), SYNTAX_ERRORS, ids=[e[0] for e in SYNTAX_ERRORS])
def test_a_syntax_error_names_file_and_line(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        ds_ring.load_config(path)
    assert str(err.value).startswith(f"{path}: {needle}"), str(err.value)


@pytest.mark.parametrize("text", ["- ring_attention\n", "just text\n", ""])
def test_the_top_level_must_be_an_object(tmp_path, text):
    path = tmp_path / "ds_config.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="a ds_config is an object of sections at the top level"):
        read_ds_config(path)


def test_initialize_reads_yaml_before_any_collective(tmp_path):
    from ds_ring.engine.initialize import initialize

    path = tmp_path / "ds_config.yml"
    path.write_text("train_micro_batch_size_per_gpu: 1\nring_attention:\n  monitoring: {metrics: true}\n")
    with pytest.raises(ValueError, match=r"monitoring.metrics is true but the ds_config enables none"):
        initialize(model=ds_ring.RingDilatedAttention(), config=path)


def test_the_trainer_takes_a_yaml_config(tmp_path):
    config = ds_config_for(str(CONFIGS / "cpu_default.yaml"), tmp_path)
    assert config["csv_monitor"]["output_path"] == str(tmp_path / "monitor")
    assert config["ring_attention"]["segment_lengths"] == [256, 1024, 2048]
