"""``python -m ds_ring.plan``: runs ``python -m ds_ring.auto`` (its new name), saying so on stderr."""

import sys

from ds_ring.auto.cli import main

print("ds_ring: `python -m ds_ring.plan` is now `python -m ds_ring.auto`", file=sys.stderr)
raise SystemExit(main())
