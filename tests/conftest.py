"""Make the repository root importable (``ds_ring``, ``tests.dist``) however pytest is invoked."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
