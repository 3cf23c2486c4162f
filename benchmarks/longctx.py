"""``python -m benchmarks.longctx [--quick] [--vocabs ...]``: whole-model long context, ds_ring vs DeepSpeed's ALST
(issue 22; the benchmark is :data:`benchmarks.hf.LONGCTX`)."""

from benchmarks.driver import main
from benchmarks.hf import LONGCTX

if __name__ == "__main__":
    raise SystemExit(main(LONGCTX))
