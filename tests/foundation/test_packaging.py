"""Package-level contracts: every package imports on a CPU machine without pulling heavy deps."""

from __future__ import annotations

import subprocess
import sys

import pytest

PACKAGES = ["mcore_distill", "mopd", "harts", "optim_staged", "colocate", "shared_teacher"]
HEAVY = ("megatron", "sglang", "transformer_engine", "transformers", "awex", "fla.ops", "triton")


@pytest.mark.parametrize("package", PACKAGES)
def test_import_is_light(package):
    code = (
        f"import sys, {package}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith('fla.ops'))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import {package} pulled in: {out.stdout.strip()}"
