"""A rank that stops answering mid-ring: every other rank fails fast, named; nothing is left running.

The main job (launch/train.py) on 3 CPU ranks, one process per rank started as a launcher would
(``RANK``/``WORLD_SIZE`` env), a dense ring over all 3, ``timeout_s`` 3 s, ``step_timeout_s`` 10 s.
In training step 3, rank 1 stops just before posting its first ring transfer (``DS_RING_FAULT``):

- ``sleep`` (hung, 600 s): ranks 0 (sending to 1) and 2 (receiving from 1) time out after 3 s,
  log the watchdog line naming themselves, peer 1, the op, the ring step, the training step and the
  layer, and exit with code 1; the sleeping rank's own step deadline ends it (code 1, stacks dumped);
- ``kill`` (SIGKILL): ranks 0 and 2 see the connection close and fail at once, named the same way.

Each survivor must exit within ``timeout_s + 10`` s of the fault (measured from the fault's own
timestamp to the process's exit), and no process of the run may be left.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.trainer_runs import free_port, reap, run_ranks, write_config

WORLD, FAULTY, FAULT_STEP = 3, 1, 3
TIMEOUT_S, STEP_TIMEOUT_S = 3.0, 10.0
LAYER = "blocks.0.attn.attention"  # the first attention of the step's forward


def _fault_time(output: str) -> float:
    found = re.search(r"ds_ring fault injection: rank 1 .* \(unix time (\d+\.\d+)\)", output)
    assert found, output[-3000:]
    return float(found.group(1))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("action", ["sleep", "kill"])
def test_a_rank_that_stops_answering_fails_every_other_rank(action: str, tmp_path: Path) -> None:
    config = write_config(tmp_path / "ds_config.json", sequence_parallel=WORLD, dense=True, timeout_s=TIMEOUT_S,
                          step_timeout_s=STEP_TIMEOUT_S)  # fmt: skip
    args = ["--deepspeed_config", str(config), "--seq", "384", "--steps", "6", "--save-every", "0",
            "--save-dir", str(tmp_path / "ckpt")]  # fmt: skip
    spec = f"{action}:rank={FAULTY}:step={FAULT_STEP}" + (":seconds=600" if action == "sleep" else "")
    try:
        exits = run_ranks(args, WORLD, free_port(), tmp_path, timeout=100, DS_RING_FAULT=spec)
    finally:
        left = reap(str(tmp_path))
    assert left == [], f"processes left running: {left}"
    fault_at = _fault_time(exits[FAULTY].output)
    for rank in (0, 2):
        out = exits[rank].output
        assert exits[rank].code == 1, f"rank {rank} exit code {exits[rank].code}:\n{out[-3000:]}"
        detected_s = exits[rank].at - fault_at
        assert detected_s <= TIMEOUT_S + 10, f"rank {rank} took {detected_s:.1f} s to fail"
        if action == "sleep":
            cause = rf"timed out after {TIMEOUT_S} s waiting for (send to|recv from) rank 1 \(op=ring_kv, step=0\)"
        else:  # the connection to the dead rank closed: posting or waiting fails at once
            cause = r"failed (waiting for|posting) [^\n]*rank 1[^\n]*\(op=ring_kv, step=0\)"
        line = rf"ds_ring watchdog: rank {rank} {cause}[^\n]*\[training step {FAULT_STEP}, layer {re.escape(LAYER)}\]"
        found = re.search(line, out)
        assert found, f"rank {rank}: no watchdog line matching {line!r}:\n{out[-3000:]}"
        assert re.search(rf"ds_ring: rank {rank} exiting with code 1 after Comm(Timeout)?Error", out), out[-3000:]
        print(f"{action}: rank {rank} exited {detected_s:.2f} s after rank {FAULTY} stopped answering: {found[0]}")
    faulty = exits[FAULTY]
    if action == "sleep":
        assert faulty.code == 1, faulty.output[-3000:]
        assert (f"ds_ring watchdog: rank {FAULTY}: training step {FAULT_STEP} still running after "
                f"{STEP_TIMEOUT_S} s (step_timeout_s)") in faulty.output  # fmt: skip
        assert faulty.at - fault_at <= STEP_TIMEOUT_S + 10
    else:
        assert faulty.code == -9, faulty.output[-3000:]
