#!/usr/bin/env bash
# SGLang GPU lane (second of the two carried commands, docs/gpu-lane.md "SGLang lane"): installs
# batch 2 of the SGLang carry, then runs in parallel, each with its own time limit and its log in
# $OUT (at most 8 files): (1) tests/colocate/test_sglang_gpu.py -k "not tp2" (in-process engine, dense + MoE);
# (2) tests/mopd/test_mopd_sglang.py (teacher server); (3) test_sglang_http.py's real-server test,
# then test_sglang_faults_gpu.py; (4) test_publish_gpu.py + test_workers_gpu.py, then
# `bench/publish.py --sglang`. Driver logs and server logs go into $OUT/artifacts.tgz. Needs
# batch 1 (`.sgl/scripts/call1.sh`) and the project wheels (.whl, .whl-sx) installed in
# /tmp/site by the first command. Prints a short table last.
#   bash scripts/sglang-lane.sh [LIMIT_S]     # per-lane limit, default 330
set -u
cd "$(dirname "$0")/.."
LIMIT=${1:-330}
OUT=${OUT:-outputs/sglang-lane}
ART=$(mktemp -d /tmp/sgl-art.XXXX)
mkdir -p "$OUT"
T0=$(date +%s)
. scripts/sglang-batch2.sh
export MCD_TEST_ARTIFACTS=$ART BENCH_OUT=$OUT
python3 -c "import torch, sglang, transformers, megatron.core as m; print('torch', torch.__version__, 'sglang', sglang.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name(0))" 2>&1 | tail -1
PT="python3 -m pytest -m sglang -o addopts= -q -rA -p no:cacheprovider"
lane() {  # lane NAME CMD...: run under the limit, output to $OUT/NAME.log
  local name=$1; shift
  timeout -k 10 "$LIMIT" bash -c "$*" > "$OUT/$name.log" 2>&1
  echo "$name exit $? after $(( $(date +%s) - T0 ))s" >> "$OUT/$name.log"
}
# the GPU tests without SGLang start at once; SGLang's JIT kernels (tvm-ffi + nvcc) for every
# shape used here are built in parallel first, so no two engines compile the same kernel at once
lane L4a-publish-gpu "python3 -m pytest -m gpu -o addopts= -q -rA -p no:cacheprovider tests/colocate/test_publish_gpu.py tests/colocate/test_workers_gpu.py" &
L4A=$!
PW=()
for op in silu qknorm rope store256; do timeout 120 python3 .sgl/scripts/prewarm.py $op > "$ART/prewarm_$op.log" 2>&1 & PW+=($!); done
timeout 120 python3 - > "$ART/prewarm128.log" 2>&1 <<'PY' &
import torch
from sglang.kernels.ops.layernorm.norm import can_use_fused_inplace_qknorm
from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache
from sglang.kernels.ops.attention.rope import apply_rope_with_cos_sin_cache_inplace
bf = torch.bfloat16
print(can_use_fused_inplace_qknorm(128, bf), can_use_store_cache(2048, 2048))
q, k = torch.randn(4, 16, 128, dtype=bf, device="cuda"), torch.randn(4, 8, 128, dtype=bf, device="cuda")
apply_rope_with_cos_sin_cache_inplace(q=q, k=k, cos_sin_cache=torch.randn(4096, 128, device="cuda"),
                                      positions=torch.arange(4, device="cuda"), is_neox=True)
torch.cuda.synchronize(); print("prewarm128 ok")
PY
PW+=($!)
wait "${PW[@]}"
echo "prewarm done after $(( $(date +%s) - T0 ))s: $(cat "$ART"/prewarm*.log | grep -c ok) ok"
lane L1-sglang-gpu "$PT -s tests/colocate/test_sglang_gpu.py -k 'not tp2'" &
lane L2-mopd-sglang "$PT -s tests/mopd/test_mopd_sglang.py" &
lane L3-http-faults "$PT -s tests/colocate/test_sglang_http.py::test_real_sglang_http_server; $PT -s tests/colocate/test_sglang_faults_gpu.py" &
wait $L4A
echo "--- L4a-publish-gpu"; grep -E " passed| failed|[0-9] error|exit [0-9]" "$OUT/L4a-publish-gpu.log" | tail -4
mv "$OUT/L4a-publish-gpu.log" "$ART/"  # at most 8 files come back from $OUT
lane L4b-bench "python3 -m bench.publish --sglang --rounds 7" &
wait
tar -czf "$OUT/artifacts.tgz" -C "$ART" . 2>/dev/null
echo "=== lanes done after $(( $(date +%s) - T0 ))s"
for f in "$OUT"/L*.log; do echo "--- $(basename "$f")"; grep -E " passed| failed|[0-9] error|exit [0-9]" "$f" | tail -4; done
grep -A14 "^provider" "$OUT/L4b-bench.log" | tail -15
