"""``python -m benchmarks``: the suite (:mod:`benchmarks.suite`); ``... install-peers``: the pinned peers (peers.py)."""

import sys

from benchmarks import driver, peers, suite

if __name__ == "__main__":
    sys.exit(peers.install() if sys.argv[1:] == ["install-peers"] else driver.main(suite.BENCHMARK))
