#!/usr/bin/env bash
# Run Horovod's own PyTorch tests (test/parallel/test_torch.py and test_adasum_pytorch.py of a
# Horovod checkout) against horovod_ext: the only change made to them is the import,
# `horovod.torch` -> `horovod_ext.torch`.
#
#   git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod /tmp/horovod
#   tools/horovod_tests.sh /tmp/horovod mpi 2      # mpirun -np 2
#   tools/horovod_tests.sh /tmp/horovod gloo 2     # hvdrun -np 2 --gloo
#   tools/horovod_tests.sh /tmp/horovod mpi 2 as-is    # no edit at all: needs compat/ installed
#                                                      # (gloo runs under horovodrun then)
#
# Each rank's pytest output goes to OUT/rank<r>.<file>.log (OUT: $HVD_TESTS_OUT or
# /tmp/horovod-tests-BACKEND-NP); the last lines print every rank's summary.  A test that hangs
# is stopped by pytest-timeout after $HVD_TESTS_TIMEOUT seconds (default 120).
set -euo pipefail
horovod=$(cd "${1:?usage: tools/horovod_tests.sh HOROVOD_CHECKOUT mpi|gloo NP}" && pwd)
backend=${2:?usage: tools/horovod_tests.sh HOROVOD_CHECKOUT mpi|gloo NP}
np=${3:?usage: tools/horovod_tests.sh HOROVOD_CHECKOUT mpi|gloo NP}
mode=${4:-rewrite}
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$repo/.venv/bin"
out=${HVD_TESTS_OUT:-/tmp/horovod-tests-$backend-$np}
[ -f "$horovod/test/parallel/test_torch.py" ] || { echo "no test/parallel/test_torch.py in $horovod" >&2; exit 2; }
"$bin/python" -c "import mock, packaging" 2>/dev/null || "$bin/pip" install -q mock packaging
rm -rf "$out"; mkdir -p "$out/suite"
cp -r "$horovod/test" "$out/suite/"
cd "$out/suite/test/parallel"
launcher="$bin/hvdrun"
if [ "$mode" = as-is ]; then
  "$bin/python" -c "import horovod.torch" || { echo "as-is needs compat/: $bin/pip install ./compat" >&2; exit 2; }
  launcher="$bin/horovodrun"
else
  sed -i -E 's/^(\s*)(import|from)(\s+)horovod\.torch\b/\1\2\3horovod_ext.torch/' test_torch.py test_adasum_pytorch.py
  # common.py imports a thread helper from Horovod's runner at module level; these tests never
  # call it, so a stand-in keeps the import from failing.
  sed -i 's/^from horovod.runner.util.threads import in_thread$/def in_thread(*args, **kwargs): raise NotImplementedError("not used by these tests")/' ../utils/common.py
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH="$repo"
rank='${OMPI_COMM_WORLD_RANK:-${HOROVOD_RANK:-0}}'
for file in test_torch test_adasum_pytorch; do
  cmd="exec $bin/python -m pytest -v -rfEs -p no:cacheprovider --timeout=${HVD_TESTS_TIMEOUT:-120} $file.py > $out/rank$rank.$file.log 2>&1"
  if [ "$backend" = mpi ]; then
    "$bin/mpirun" -np "$np" --oversubscribe --bind-to none bash -c "$cmd" || true
  else
    "$launcher" -np "$np" --gloo bash -c "$cmd" || true
  fi
  for log in "$out"/rank*."$file".log; do
    echo "$(basename "$log"): $(tail -n 1 "$log")"
  done
done
# HVD_TESTS_RECORD=FILE keeps a record of the run (docs/conformance/ holds the published ones):
# what ran, on which commit and when, rank 0's result for every test, and every rank's summary.
if [ -n "${HVD_TESTS_RECORD:-}" ]; then
  {
    echo "# tools/horovod_tests.sh HOROVOD_CHECKOUT $backend $np $mode"
    echo "# horovod_ext $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD -- horovod_ext || echo +changes), Horovod $(cat "$horovod/COMMIT" 2>/dev/null || git -C "$horovod" rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%Y-%m-%d), $("$bin/python" -c 'import torch; print("torch", torch.__version__)')"
    for file in test_torch test_adasum_pytorch; do
      grep -E '::.* (PASSED|FAILED|SKIPPED|ERROR)' "$out/rank0.$file.log" | sed -E 's/ +\[ *[0-9]+%\]$//'
      grep -E '^(FAILED|ERROR|SKIPPED) ' "$out/rank0.$file.log" || true
      for log in "$out"/rank*."$file".log; do echo "$(basename "$log"): $(tail -n 1 "$log")"; done
    done
  } > "$HVD_TESTS_RECORD"
fi
