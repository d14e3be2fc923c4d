#!/usr/bin/env bash
# Download the small cp312/manylinux wheels the GPU box lacks into an ignored .whl/ (< 64 MiB).
# The box already has torch 2.11.0+cu130, triton 3.6.0, transformers, pytest(-timeout), hypothesis,
# numpy, einops, absl-py, cloudpickle, requests, aiohttp, psutil, tqdm, matplotlib, tensorboard.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=.whl
mkdir -p "$DEST"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
WHEELS=(
  "megatron-core==0.19.2"
  "emerging-optimizers==0.3.0"
  "fla-core==0.6.0"
  "hydra-core==1.3.8"
  "omegaconf==2.3.1"
  "awex==0.9.0"
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DEST" "${WHEELS[@]}" \
  || { echo "error: downloading GPU-lane wheels failed (needs PyPI access)" >&2; exit 1; }
# antlr4-python3-runtime (hydra's parser) ships only an sdist: build its wheel here.
ls "$DEST"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 || \
  "$PY" -m pip wheel -q --no-deps -w "$DEST" "antlr4-python3-runtime==4.9.3" \
  || { echo "error: building the antlr4-python3-runtime wheel failed" >&2; exit 1; }
du -ch "$DEST"/*.whl | tail -n 1
