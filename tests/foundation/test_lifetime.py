"""A torchrun rank follows its launcher: torchrun starts ranks in sessions of their own, so when
torchrun itself is SIGKILLed its ranks live on, unless they called
:func:`mcore_distill.lifetime.end_with_launcher`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_distill.lifetime import end_with_launcher
from tests._procs import alive

ROOT = Path(__file__).resolve().parents[2]
RANK = """
import os, sys, time
from mcore_distill.lifetime import end_with_launcher
armed = end_with_launcher(poll_s=0.1) if sys.argv[2] == "guard" else False
open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w").write(f"{os.getpid()} {int(armed)}")
time.sleep(120)
"""


def _ranks_after_killing_torchrun(tmp_path: Path, mode: str) -> list[tuple[int, int]]:
    """Start 2 ranks under torchrun, SIGKILL torchrun once both have started; return
    ``(pid, armed)`` per rank, 3 s after the kill."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), str(tmp_path), mode], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    files = [tmp_path / "rank0", tmp_path / "rank1"]
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in files) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [tuple(int(x) for x in f.read_text().split()) for f in files]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    time.sleep(3.0)
    return ranks


@pytest.mark.timeout(120)
def test_torchrun_ranks_end_with_a_killed_torchrun_only_when_guarded(tmp_path):
    (tmp_path / "guard").mkdir()
    (tmp_path / "none").mkdir()
    guarded = _ranks_after_killing_torchrun(tmp_path / "guard", "guard")
    unguarded = _ranks_after_killing_torchrun(tmp_path / "none", "none")
    try:
        assert [armed for _, armed in guarded] == [1, 1]
        assert not any(alive(pid) for pid, _ in guarded), "a guarded rank outlived its SIGKILLed torchrun"
        # the control: without the guard the ranks do outlive torchrun (so the check above can fail)
        assert all(alive(pid) for pid, _ in unguarded)
    finally:
        for pid, _ in guarded + unguarded:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_outside_torchrun_nothing_is_armed(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert end_with_launcher() is False
