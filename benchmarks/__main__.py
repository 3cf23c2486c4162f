"""``python -m benchmarks [--quick] [--out DIR]``: the suite (:mod:`benchmarks.suite`);
``python -m benchmarks install-peers``: install the pinned comparison libraries (:mod:`benchmarks.peers`)."""

import sys

from benchmarks import peers, suite
from benchmarks.driver import main

if __name__ == "__main__":
    sys.exit(peers.install() if sys.argv[1:] == ["install-peers"] else main(suite.BENCHMARK))
