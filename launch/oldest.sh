#!/usr/bin/env bash
# The declared lower bounds, tested: creates .venv-oldest (once) with the CPU build of torch installed first (as
# launch/bootstrap.sh does), then ds_ring's dev extra with transformers, accelerate and DeepSpeed pinned to the
# lowest releases setup.cfg allows (launch/oldest-constraints.txt), and runs the tests that use them there: every
# Hugging Face test, the DeepSpeed engine and ZeRO tests, the ds_config section. Arguments replace that test list.
# Exits with pytest's status. Idempotent: a second run only re-checks the pins and re-installs ds_ring.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-oldest
CONSTRAINTS=launch/oldest-constraints.txt
TORCH_SPEC="$(grep '^torch==' "$CONSTRAINTS")"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/pip" install -q "$TORCH_SPEC"
fi
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" -e ".[dev]"
"$VENV/bin/python" - "$CONSTRAINTS" <<'PY'
import sys
from importlib.metadata import version

pins = dict(line.strip().split("==") for line in open(sys.argv[1]) if "==" in line and not line.startswith("#"))
got = {name: version(name).split("+")[0] for name in pins}
print("oldest: " + ", ".join(f"{name} {got[name]}" for name in pins))
assert got == pins, f"installed {got}, pinned {pins}"
PY
if [ "$#" -eq 0 ]; then
  set -- tests/test_hf_*.py tests/test_model_zoo.py tests/test_alst_ulysses_sp_hf.py tests/test_zero_equivalence.py tests/test_zero_gathers_wait.py \
    tests/test_config.py tests/test_deepspeed_collective_errors.py
fi
# DeepSpeed's CPU ops are compiled per DeepSpeed release: a cache of their own
export TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions-oldest"
"$VENV/bin/python" launch/build_ops.py
"$VENV/bin/python" -m pytest -q -m "not zoo and not multihost and not slow" "$@"  # the launcher jobs too
