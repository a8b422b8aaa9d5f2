#!/usr/bin/env bash
# The test suite as CI runs it: every test, two processes (one per core), each taking the next test as it finishes
# one (slow tests first); then the tests marked `numerics` (known answers, controllers, the guard, end-to-end training)
# a second time under another CPU kernel set, so that a verdict that holds only with this host's kernels fails here
# and not on a user's machine. torch picks its CPU kernels by instruction set (ATEN_CPU_CAPABILITY: default, avx2,
# avx512); the second pass takes `default`, the portable set every x86-64 CPU has. On a CPU whose own set is `default`
# there is no other set to try, and the pass is skipped. Arguments go to both pytest runs (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m pytest -q -n 2 --dist worksteal "$@"
own=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
if [ "$own" = default ]; then
  echo "scripts/test.sh: this CPU's kernel set is already 'default', the portable one: no second kernel set to run under"
  exit 0
fi
echo "scripts/test.sh: the numerics tests again under ATEN_CPU_CAPABILITY=default (this CPU's own set: $own)"
ATEN_CPU_CAPABILITY=default "$PY" -m pytest -q -n 2 --dist worksteal -m numerics -p no:cacheprovider "$@"
