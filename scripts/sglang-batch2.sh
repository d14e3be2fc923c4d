# Sourced by scripts/colocated-gpu.sh and scripts/sglang-lane.sh (second of the two carried SGLang
# commands, docs/gpu-lane.md "SGLang lane"): checks that batch 1 (.sgl/scripts/call1.sh) is still
# installed, installs batch 2 of the carry, and exports the environment the SGLang runs share
# (PYTHONPATH over both batches, /tmp/site and the repo; offline Hugging Face; nvcc on PATH).
# Needs T0 (start time, for the timing line).
TMPD=$(python3 -c 'import tempfile; print(tempfile.gettempdir())')
S1=$TMPD/site1 S2=$TMPD/site2
[ -d "$S1/sglang" ] || { echo "batch 1 is not installed (the machine went cold): run .sgl/scripts/call1.sh first"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S2" .sgl/b02/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=$S2:$S1:/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
which nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
echo "batch 2 installed in $(( $(date +%s) - T0 ))s"
