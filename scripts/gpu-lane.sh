#!/usr/bin/env bash
# GPU lane: install the carried wheels (.whl/, from scripts/gpu-wheels.sh) on the H200 box, then run
# the GPU tests (pytest -m gpu) and the benchmarks. Results go to $OUT (or ./outputs/gpu-lane):
# lane.tar.gz (logs, JUnit XML, benchmark JSON + PNG) and summary.txt; a short table is printed last.
#
#   bash scripts/gpu-lane.sh                 # tests + all benchmarks
#   bash scripts/gpu-lane.sh tests [PATHS/PYTEST ARGS...]   # default path: tests
#   bash scripts/gpu-lane.sh bench NAME [ARGS...]   # one benchmark, e.g. bench optim_staged --quick
#   bash scripts/gpu-lane.sh benches NAME...        # several benchmarks with default arguments
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-lane}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/lane.XXXX)
export BENCH_OUT="$WORK/bench" PYTHONUNBUFFERED=1
mkdir -p "$BENCH_OUT"
PY=${PY:-python3}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "error: no CUDA device visible to $PY (torch.cuda.is_available() is False): run this on the GPU box" >&2
  exit 2
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing carried wheels from .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  echo "note: no .whl/ carried; using the packages already installed" >&2
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# Triton autotuning results survive fresh boxes: they are written to the Triton cache
# (TRITON_CACHE_AUTOTUNING=1), exported as $OUT/autotune.tar.gz (*.autotune.json only, a few KB
# each) and read back from an ignored .autotune/ folder when one is carried (unpack the tarball
# there). FLA's kernels then compile only their chosen configuration instead of timing every one.
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
# scripts/gpu-autotune.tar.gz (tracked, ~20 KB) holds the last exported set, so a fresh checkout on a
# new machine does not re-tune; a carried .autotune/ (newer) is copied over it.
[ -f scripts/gpu-autotune.tar.gz ] && tar -xzf scripts/gpu-autotune.tar.gz -C "$TRITON_CACHE_DIR"
[ -d .autotune ] && cp -r .autotune/. "$TRITON_CACHE_DIR"/
"$PY" - <<'PY' | tee "$WORK/versions.txt"
import torch, importlib
print("gpu:", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())
for m in ("torch", "triton", "megatron.core", "emerging_optimizers", "fla", "transformers", "awex", "hydra"):
    try:
        print(f"{m}: {getattr(importlib.import_module(m), '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"{m}: not importable ({type(e).__name__}: {e})")
PY

rc=0
run_tests() {
  # SGLang tests need the two-call carry (docs/gpu-lane.md, "SGLang lane"); all other gpu tests run here.
  [ $# -gt 0 ] || set -- tests
  "$PY" -m pytest -m "gpu and not sglang" -q -p no:cacheprovider --junitxml="$WORK/gpu-tests.xml" -o addopts="-ra" "$@" \
    2>&1 | tee "$WORK/gpu-tests.log"
  local r=${PIPESTATUS[0]}
  [ "$r" -eq 0 ] || rc=$r
}
run_bench() {
  local name=$1; shift
  echo "=== python -m bench.$name $*"
  "$PY" -m "bench.$name" "$@" 2>&1 | tee "$WORK/bench-$name.log"
  local r=${PIPESTATUS[0]}
  [ "$r" -eq 0 ] || { echo "bench $name failed with exit $r"; rc=$r; }
}

mode=${1:-all}
case "$mode" in
  tests) shift; run_tests "$@" ;;
  bench) shift; run_bench "$@" ;;
  benches) shift; for n in "$@"; do run_bench "$n"; done ;;
  all)
    run_tests
    for f in bench/*.py; do
      n=$(basename "$f" .py)
      case "$n" in _*|plot|__init__) continue ;; esac
      run_bench "$n"
    done ;;
  *) echo "usage: $0 [all | tests [pytest args] | bench NAME [args] | benches NAME...]" >&2; exit 2 ;;
esac

{
  cat "$WORK/versions.txt"
  [ -f "$WORK/gpu-tests.log" ] && tail -n 15 "$WORK/gpu-tests.log"
  for f in "$WORK"/bench-*.log; do [ -f "$f" ] && { echo "--- $(basename "$f")"; tail -n 25 "$f"; }; done
} > "$WORK/summary.txt"
tar -czf "$OUT/lane.tar.gz" -C "$WORK" . && cp "$WORK/summary.txt" "$OUT/summary.txt"
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/autotune.tar.gz" -T -)
echo "=== summary (full results: $OUT/lane.tar.gz)"
cat "$WORK/summary.txt"
exit $rc
