"""Build DeepSpeed's JIT-compiled CPU op once, before any timed test or job, into the cache they use.

DeepSpeed compiles ``deepspeed_shm_comm`` (~90 s) the first time a process group starts; done inside a job or a
test with a deadline, a kill mid-build leaves a lock behind (:mod:`ds_ring.engine.build_locks`). ``launch/bootstrap.sh``
and ``launch/oldest.sh`` run this with the tests' ``TORCH_EXTENSIONS_DIR``; a stale lock is removed first, with a
warning naming it.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from ds_ring.engine.build_locks import clear_stale_build_locks, extensions_dir  # noqa: E402

clear_stale_build_locks()
from deepspeed.comm.torch import build_shm_op  # noqa: E402

state = "ready" if build_shm_op() is not None else "not used here"
print(f"build_ops: DeepSpeed's shm op {state} in {extensions_dir()}")
