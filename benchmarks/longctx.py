"""Whole-model long context (issue 22): ``python -m benchmarks.longctx [--quick] [--vocabs 32000 128256]``; the
benchmark is :data:`benchmarks.hf.LONGCTX` (``benchmarks/SUITE.md``)."""

import sys

from benchmarks.driver import main
from benchmarks.hf import LONGCTX

if __name__ == "__main__":
    sys.exit(main(LONGCTX))
