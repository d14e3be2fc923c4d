#!/usr/bin/env bash
# Download the TileLang stack that fla-core's Gated DeltaNet backward needs on Hopper with Triton 3.6
# (fla #640) into ignored .tl/a and .tl/b: two carries of < 64 MiB each, installed by two consecutive
# GPU-lane commands into one target (docs/gpu-lane.md, "Gated DeltaNet lane (tilelang)").
# tilelang 0.1.15 declares z3-solver < 4.15.5, but 4.15.4 is gone from the index; 4.15.8 ships the
# same libz3.so.4.15 soname that tilelang's libraries load, and ran the GDN lane on 2026-12-02.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
grep -qxF '/.tl/' .git/info/exclude 2>/dev/null || grep -qxF '/.tl/' .gitignore || echo '/.tl/' >> .git/info/exclude
mkdir -p .tl/a .tl/b
get() {  # get DEST SPEC...
  local dest=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform any -d "$dest" "$@" \
    || { echo "error: downloading $* failed (needs PyPI access)" >&2; exit 1; }
}
get .tl/a "z3-solver==4.15.8.0"
get .tl/b "tilelang==0.1.15" "apache-tvm-ffi==0.1.12" "torch-c-dlpack-ext==0.1.5" "einops"
du -ch .tl/a/*.whl | tail -n 1
du -ch .tl/b/*.whl | tail -n 1
