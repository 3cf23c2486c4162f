#!/usr/bin/env bash
# The declared version range, tested at both ends: `launch/versions.sh oldest|newest [tests...]` creates
# .venv-<name> (once), installs ds_ring's dev extra with torch, transformers, accelerate and DeepSpeed pinned by
# launch/<name>-constraints.txt (torch the registry's build: a CUDA build, which runs on CPU), checks that the
# installed versions equal the pins, builds DeepSpeed's CPU ops into their own cache and runs the tests that depend
# on those packages: the block kernels and the oracle, every Hugging Face test, the DeepSpeed engine and ZeRO tests,
# the ds_config section (the ring / Ulysses / hybrid modules by hand: the list below). Arguments after the name
# replace that test list. Exits with pytest's status. Idempotent: a second run (same constraints and setup.cfg) only
# re-installs ds_ring (without its dependencies) and re-checks the pins.
# launch/oldest.sh and launch/newest.sh call this with their name.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME="${1:?usage: launch/versions.sh oldest|newest [--prepare | test files...]}"
shift
# --prepare: install, check the pins and build the ops, run no test (CI prepares both venvs while its second step runs)
PREPARE=0
if [ "${1:-}" = "--prepare" ]; then
  PREPARE=1
  shift
fi
CONSTRAINTS="launch/$NAME-constraints.txt"
if [ ! -f "$CONSTRAINTS" ]; then
  echo "versions.sh: no $CONSTRAINTS (the names are: $(ls launch/*-constraints.txt | sed 's|launch/||; s|-constraints.txt||' | tr '\n' ' '))" >&2
  exit 2
fi
VENV=".venv-$NAME"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# What the venv was installed from: once installed, a run re-installs ds_ring alone (--no-deps), since resolving the
# dev extra again would bring back the triton removed below (~250 MB to fetch, and DeepSpeed 0.16 fails with it)
INSTALLED="$VENV/.ds_ring-installed-from"
FROM="$(cat "$CONSTRAINTS" setup.cfg | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$INSTALLED" 2>/dev/null)" = "$FROM" ]; then
  "$VENV/bin/pip" install -q --no-deps -e .
else
  # torch first, alone: its ~3 GB of CUDA libraries are the slow part, and a failure there names torch
  "$VENV/bin/pip" install -q "$(grep '^torch==' "$CONSTRAINTS")"
  "$VENV/bin/pip" install -q -c "$CONSTRAINTS" -e ".[dev]"
  # The registry's torch brings triton, and DeepSpeed 0.16 compiles triton kernels when it is imported, which raises
  # "0 active drivers" where there is no GPU driver: without CUDA the venv goes without triton (eager torch needs none)
  if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    "$VENV/bin/pip" uninstall -q -y triton 2>/dev/null || true
  fi
  echo "$FROM" > "$INSTALLED"
fi
"$VENV/bin/python" - "$NAME" "$CONSTRAINTS" <<'PY'
import sys
from importlib.metadata import version

name, constraints = sys.argv[1:]
pins = dict(line.strip().split("==") for line in open(constraints) if "==" in line and not line.startswith("#"))
got = {package: version(package).split("+")[0] for package in pins}
print(f"{name}: " + ", ".join(f"{package} {got[package]}" for package in pins))
assert got == pins, f"installed {got}, pinned {pins}"
PY
if [ "$#" -eq 0 ]; then
  # the ring / Ulysses / hybrid modules (test_dilated_attention.py test_ring_attention.py
  # test_ring_dilated_attention.py test_ulysses_hybrid.py test_attention_modules.py, ~10 min more) are passed by hand;
  # the zoo harness (test_model_zoo.py) builds the newest transformers' families in float64 throughout: not here
  set -- tests/test_block_kernels.py tests/test_merge.py tests/test_reference.py \
    tests/test_hf_*.py tests/test_alst_ulysses_sp_hf.py tests/test_zero_equivalence.py \
    tests/test_zero_gathers_wait.py tests/test_config.py tests/test_deepspeed_collective_errors.py
fi
# DeepSpeed's CPU ops are compiled per torch and DeepSpeed release: a cache of their own
export TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions-$NAME"
"$VENV/bin/python" launch/build_ops.py
if [ "$PREPARE" = 1 ]; then
  exit 0
fi
# the launcher jobs too at the oldest end; at the newest they are CI's second step's, on the same transformers,
# accelerate and DeepSpeed (only torch differs: 2.13.0 there)
MARKERS="not zoo and not multihost and not slow and not heavy"
if [ "$NAME" = newest ]; then
  MARKERS="$MARKERS and not jobs"
fi
"$VENV/bin/python" -m pytest -q -m "$MARKERS" "$@"
