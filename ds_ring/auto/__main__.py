"""``python -m ds_ring.auto``: what ``strategy="auto"`` would choose, before any run (:mod:`ds_ring.auto.cli`)."""

from ds_ring.auto.cli import main

raise SystemExit(main())
