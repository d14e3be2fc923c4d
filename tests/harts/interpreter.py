"""Run a ``tests.harts`` script under Triton's CPU interpreter in a subprocess (``TRITON_INTERPRET=1``
must be set before Triton is imported) and return the JSON it prints on its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(module: str, payload) -> dict:
    """``python -m tests.harts.<module> '<payload as JSON>'`` from the repository root."""
    out = subprocess.run([sys.executable, "-m", f"tests.harts.{module}", json.dumps(payload)],
                         cwd=Path(__file__).resolve().parents[2], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
