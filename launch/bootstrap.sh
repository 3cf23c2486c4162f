#!/usr/bin/env bash
# Creates .venv (once) with a CPU build of torch installed *before* anything that depends on it,
# so pip never resolves torch to a multi-GB CUDA build, then installs ds_ring with its dev and mpi
# extras. Installs Open MPI (for `mpirun` and mpi4py) from Debian when it is missing and we are root.
# Idempotent: a second run only re-installs ds_ring in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${DS_RING_TORCH:-torch==2.13.0}"
if ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  else
    echo "bootstrap: mpirun not found and not root: the mpirun launcher test will be skipped" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "$TORCH_SPEC"
fi
.venv/bin/pip install -q -e ".[dev,mpi]"
# DeepSpeed's CPU op, built once now (not inside a timed test or the main job) into the tests' cache
TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}" .venv/bin/python launch/build_ops.py
