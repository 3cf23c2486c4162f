"""``mpirun`` across the two network hosts: started on node0, it starts node1's ranks through an ``ssh``
stand-in that enters node1's namespace (``plm_rsh_agent``), and the main job runs as 2 hosts × 2 ranks
(ranks from mpi4py, ``MASTER_ADDR=node0``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.multihost.hosts import TwoHosts
from tests.trainer_runs import TRAIN, write_config


def test_mpirun_starts_the_main_job_on_both_hosts(hosts: TwoHosts, tmp_path: Path) -> None:
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin libopenmpi-dev; .ci/run installs it)")
    pytest.importorskip("mpi4py", reason="pip install -e .[mpi]")
    config = write_config(tmp_path / "ds_config.json", sequence_parallel=4, timeout_s=30)
    hosts.mpirun([TRAIN, "--deepspeed_config", str(config), "--seq", "512", "--steps", "2", "--save-every", "2",
                  "--save-dir", str(tmp_path / "ckpt")], tmp_path)  # fmt: skip
    codes = hosts.wait(150)
    output = hosts.output(0)
    assert codes == [0], output[-4000:]
    for host in hosts.hostnames:  # --display-map: two ranks on each host
        assert f"Data for node: {host}\tNum slots: 2" in output, output[:3000]
    assert all(f"rank {r}:" in output for r in range(4)), output[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step2"
