#!/usr/bin/env bash
# Creates .venv (once) with a CPU build of torch installed *before* anything that depends on it,
# so pip never resolves torch to a multi-GB CUDA build, then installs ds_ring with its dev extras.
# Idempotent: a second run only re-installs ds_ring in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${DS_RING_TORCH:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "$TORCH_SPEC"
fi
.venv/bin/pip install -q -e ".[dev]"
