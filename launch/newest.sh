#!/usr/bin/env bash
# The newest releases this machine's pip allows (launch/newest-constraints.txt), installed into .venv-newest and
# tested there: launch/versions.sh, which says how. Arguments replace the test list. Without arguments, the tests
# that lean on torch's own APIs: the block kernels and the oracle, the custom ops under torch.compile, HF models end
# to end, DeepSpeed's ZeRO stages (the rest of the suite runs on the same transformers, accelerate and DeepSpeed in
# .venv, whose torch is 2.13.0; `launch/versions.sh newest` alone runs launch/oldest.sh's longer list).
if [ "$#" -eq 0 ]; then
  set -- tests/test_block_kernels.py tests/test_merge.py tests/test_reference.py tests/test_compile.py \
    tests/test_hf_equivalence.py tests/test_hf_zero.py tests/test_hf_long_context.py tests/test_alst_ulysses_sp_hf.py \
    tests/test_zero_equivalence.py tests/test_config.py
fi
exec bash "$(dirname "$0")/versions.sh" newest "$@"
