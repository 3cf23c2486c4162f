"""Rank discovery from each launcher's environment, without starting processes."""

import pytest

from ds_ring.engine.launch_env import discover_launch_env

KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
LAUNCHERS = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NTASKS_PER_NODE",
             "OMPI_COMM_WORLD_RANK", "PMI_RANK"]  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in KEYS + LAUNCHERS:
        monkeypatch.delenv(key, raising=False)


def test_torchrun_and_deepspeed_env_is_kept(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert discover_launch_env() == "env"


def test_slurm(monkeypatch):
    for key, value in dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_NTASKS_PER_NODE="4(x2)",
                           SLURM_JOB_NODELIST="gpu[01-02]").items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert discover_launch_env() == "slurm"
    import os

    assert [os.environ[k] for k in KEYS[:5]] == ["5", "8", "1", "4", "127.0.0.1"]


def test_slurm_without_master_addr_uses_first_node(monkeypatch):
    import os

    for key, value in dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="node7,node8").items():
        monkeypatch.setenv(key, value)
    assert discover_launch_env() == "slurm"
    assert os.environ["MASTER_ADDR"] == "node7"


def test_no_launcher_is_a_world_of_one_on_loopback():
    import os

    assert discover_launch_env() == "single"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
