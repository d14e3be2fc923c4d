#!/usr/bin/env bash
# GPU lane for examples/train_gpu.py: one run per model config, each under a time limit; results
# (JSON per model) in $OUT/train_gpu/, the printed tables on stdout.
#
#   bash examples/train_gpu_lane.sh                        # qwen3_dense_0p6b qwen3_dense_1p7b qwen3_moe_small qwen3_moe_30b_a3b
#   bash examples/train_gpu_lane.sh qwen3_dense_8b         # any models from examples/configs/model/
#   LIMIT=300 bash examples/train_gpu_lane.sh qwen3_next_hybrid_small   # PYTHONPATH must hold tilelang (docs/gpu-lane.md)
#   EXTRA="workload.kind=agent workload.num_groups=8" bash examples/train_gpu_lane.sh qwen3_dense_0p6b
#
# Default workload per step: 4 GRPO groups x 8 responses x (512 prompt + 512 response) tokens
# (sum L = 32768, tree T = 18432), overridable with EXTRA (Hydra overrides, space separated).
# qwen3_moe_30b_a3b is expected to stop at once with DeviceMemoryError (it needs more than one GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-lane}
PY=${PY:-python3}
mkdir -p "$OUT/train_gpu"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/megatron ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing carried wheels from .whl/ failed" >&2; exit 1; }
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
models=${*:-qwen3_dense_0p6b qwen3_dense_1p7b qwen3_moe_small qwen3_moe_30b_a3b}
EXTRA=${EXTRA:-workload.prompt_len=512 workload.response_len=512}
rc=0
for m in $models; do
  echo "=== model=$m (limit ${LIMIT:-150}s)"
  # shellcheck disable=SC2086
  timeout "${LIMIT:-150}" "$PY" -m examples.train_gpu "model=$m" $EXTRA "out_json=$OUT/train_gpu/$m.json" \
    "hydra.run.dir=/tmp/train_gpu_hydra" > "$OUT/train_gpu/$m.log" 2>&1
  r=$?
  grep -v -e "DEPRECATED" -e "full_param_layout" "$OUT/train_gpu/$m.log" | tail -n 14
  echo "exit $r"
  [ "$r" -eq 0 ] || rc=$r
done
exit $rc
