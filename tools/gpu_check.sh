#!/usr/bin/env bash
# Everything this project checks on a GPU, in one command, within 6 minutes, offline: the
# project's source and an installed PyTorch with CUDA are all it needs (no pip install).
#
#   tools/gpu_check.sh [OUT]        # OUT: results folder, default $OUT or /tmp/gpu_check
#
# Steps, each under its own time limit (and all within $GPU_CHECK_BUDGET_S, default 360 s):
#   environment  nvidia-smi, Python, torch, CUDA, NCCL, the GPUs, the compiler, the commit
#   build        the optional C kernels in place (setup.py build_ext --inplace), if a C
#                compiler and setuptools are here; without them the torch code runs
#   cuda_tests   pytest -m cuda tests/test_cuda.py (CUDA against CPU, np=1 and np=2)
#   api_tests    the Horovod-API tests that meet a GPU machine's start-up path (an NCCL
#                group beside Gloo): collectives, DistributedOptimizer, the shared-GPU check,
#                the README's example; Gloo only (MPI may not be installed)
#   benchmark    python benchmarks/gpu.py --out OUT (table in benchmark.log, OUT/gpu.json)
#   kernels      python benchmarks/gpu_kernels.py --out OUT --code --only (the shipped
#                kernels): the device kernels of a step (kernels.log, OUT/gpu_kernels.json) and
#                Inductor's code; its other variants take minutes to compile: run them apart
# OUT/summary.txt says what passed; the exit status is 0 when every step passed.
# Without CUDA it says so, runs nothing but the environment report (a dry run) and exits 0.
# $PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
set -u
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=${1:-${OUT:-/tmp/gpu_check}}
budget=${GPU_CHECK_BUDGET_S:-360}
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then
    py="$repo/.venv/bin/python"
  else
    py=$(command -v python3 || echo python3)
  fi
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
summary="$out/summary.txt"
: > "$summary"
start=$SECONDS
failed=0

say() { echo "gpu_check: $*" | tee -a "$summary"; }

# step NAME LIMIT_S COMMAND...: run it with its output in OUT/NAME.log, cut at LIMIT_S seconds
# or at what is left of the budget, whichever comes first
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    say "$name: NOT RUN, the ${budget} s budget is spent"; failed=1; return
  fi
  local t0=$SECONDS rc=0
  # through bash -c, so that COMMAND may be one of the functions below (exported)
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > "$out/$name.log" 2>&1 || rc=$?
  local took=$((SECONDS - t0))
  if [ $rc -eq 0 ]; then
    say "$name: passed in ${took} s ($out/$name.log)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    say "$name: TIMED OUT after ${limit} s ($out/$name.log)"; failed=1
  else
    say "$name: FAILED, exit status $rc after ${took} s ($out/$name.log)"; failed=1
  fi
}

environment() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)"
  echo "commit: $(git -C "$repo" rev-parse --short HEAD 2> /dev/null || echo unknown)"
  echo "python: $py"
  if command -v nvidia-smi > /dev/null; then
    timeout 10 nvidia-smi || echo "nvidia-smi failed"
    timeout 10 nvidia-smi topo -m 2>/dev/null || true
  else
    echo "nvidia-smi: not found"
  fi
  echo "C compiler: $( (cc --version || gcc --version) 2>/dev/null | head -1 || echo none)"
  "$py" - <<'EOF'
import torch
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
      f"CUDA available: {torch.cuda.is_available()}")
try:
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as exc:  # a CPU build has no NCCL to ask
    print(f"NCCL: unknown ({type(exc).__name__})")
import torch.distributed as dist
print(f"torch.distributed: gloo {dist.is_gloo_available()}, nccl {dist.is_nccl_available()}")
for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, capability {p.major}.{p.minor}, "
          f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
EOF
}

build() {
  if ! command -v cc > /dev/null && ! command -v gcc > /dev/null; then
    echo "no C compiler: the torch code runs instead of the C kernels"; return 0
  fi
  if ! "$py" -c "import setuptools" 2> /dev/null; then
    echo "no setuptools: the torch code runs instead of the C kernels"; return 0
  fi
  "$py" setup.py build_ext --inplace
}

export -f environment build
export py repo
step environment 15 environment
cat "$out/environment.log"
if ! "$py" -c "import torch" 2> /dev/null; then
  say "FAILED: $py cannot import torch (set PYTHON to an interpreter that has PyTorch)"
  exit 2
fi
# exit status 3: no CUDA (any other failure is an error, not a dry run)
cuda=$("$py" -c "
import torch
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0))
else:
    why = 'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'
    print(f'torch {torch.__version__}: {why}')
    raise SystemExit(3)
" 2>&1)
rc=$?
if [ $rc -eq 3 ]; then
  say "CUDA is not available ($cuda): dry run, nothing was run on a GPU."
  say "on a GPU machine this runs: build, cuda_tests (pytest -m cuda tests/test_cuda.py)," \
      "api_tests, benchmark (benchmarks/gpu.py --out $out), kernels" \
      "(benchmarks/gpu_kernels.py); results in $out"
  exit 0
elif [ $rc -ne 0 ]; then
  say "FAILED: asking torch about CUDA: $cuda"
  exit 2
fi
say "CUDA device: $cuda"

step build 40 build
if "$py" -c "import pytest" 2> /dev/null; then
  step cuda_tests 200 "$py" -m pytest -p no:cacheprovider -ra -m cuda tests/test_cuda.py \
    --junitxml="$out/cuda_tests.xml"
  step api_tests 75 "$py" -m pytest -p no:cacheprovider -ra -k "not mpi" \
    tests/test_collectives.py tests/test_optimizer.py tests/test_devices.py \
    tests/test_example.py --junitxml="$out/api_tests.xml"
else
  say "cuda_tests, api_tests: NOT RUN, $py has no pytest"; failed=1
fi
step benchmark 120 "$py" benchmarks/gpu.py --out "$out"
step kernels 60 "$py" benchmarks/gpu_kernels.py --out "$out" --code \
  --only adam_fused,lamb,slamb,onebit_compress,onebit_decompress
verdict="every step passed"
[ $failed -eq 0 ] || verdict="some steps did not pass"
say "$verdict in $((SECONDS - start)) s; results in $out"
exit $failed
