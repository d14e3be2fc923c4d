#!/usr/bin/env bash
# The colocated job on the GPU lane with a real SGLang engine (second of the two carried commands;
# docs/gpu-lane.md "SGLang lane"): installs batch 2 of the SGLang carry and the project wheels
# (.whl, .whl-sx), then runs `examples.demo.run --config-name gpu` under torchrun (1 rank) with its
# log in $OUT, and copies results.json, steps.jsonl, the plot and every log of the run (teacher
# server, failure record, Hydra) into $OUT whatever the exit. SGLang's JIT kernels for the shapes
# of conf/gpu.yaml (head_dim 64, 2 KV heads) are built in parallel before the job starts.
#   bash scripts/colocated-gpu.sh [LIMIT_S] [HYDRA OVERRIDES...]   # default limit 480 s (keep the
#   device call's own limit ≥ LIMIT_S + 60 s so the logs come back)
set -u
cd "$(dirname "$0")/.."
LIMIT=${1:-480}; shift || true
OUT=${OUT:-outputs/colocated-gpu}
mkdir -p "$OUT"
T0=$(date +%s)
. scripts/sglang-batch2.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-sx/*.whl 2>&1 | grep -v "already exists" | tail -3
export MCD_COMMIT=${MCD_COMMIT:-unknown}
echo "project wheels installed after $(( $(date +%s) - T0 ))s"
RUN=/tmp/colocated
collect() {
  for f in results.json steps.jsonl demo.png failure.json; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"; done
  ls -R "$RUN" > "$OUT/files.txt" 2>&1
  tar -czf "$OUT/logs.tgz" --exclude=cache --exclude=ckpt -C "$RUN" . 2>/dev/null
}
trap collect EXIT
PW=()
for op in silu qknorm rope store256; do timeout 120 python3 .sgl/scripts/prewarm.py $op > "/tmp/prewarm_$op.log" 2>&1 & PW+=($!); done
wait "${PW[@]}"
echo "prewarm after $(( $(date +%s) - T0 ))s: $(cat /tmp/prewarm_*.log | grep -c ' ok ') of 4 ok"
timeout -k 15 "$LIMIT" python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m examples.demo.run \
  --config-name gpu out_dir=$RUN "$@" > "$OUT/run.log" 2>&1
rc=$?
echo "run exit $rc after $(( $(date +%s) - T0 ))s" | tee -a "$OUT/run.log"
grep -v "Warning\|warnings.warn\|^  warn" "$OUT/run.log" | tail -c 9000
exit $rc
