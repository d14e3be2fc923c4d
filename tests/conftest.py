"""Shared pytest setup: GPU tests skip without CUDA (the GPU lane runs them with -m gpu); every
test is checked for processes it leaves behind."""

from __future__ import annotations

import os
import sys
import time
import warnings

import psutil
import pytest
import torch

# Keep CPU tests single-threaded per process: CI has 2 cores and multi-rank tests spawn 2 ranks.
torch.set_num_threads(int(os.environ.get("MCORE_DISTILL_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU lane: scripts/gpu-lane.sh)")
    for item in items:
        if "gpu" in item.keywords or "sglang" in item.keywords:
            item.add_marker(skip)


class LeakedProcessWarning(UserWarning):
    """A test left a process of this interpreter running outside the test session's process tree."""


@pytest.fixture(autouse=True)
def _no_orphaned_processes():
    """Warn (naming the test) about processes of this Python started during the test that outlive
    it outside pytest's process tree, e.g. the child of a rank that was killed: they keep memory on
    the CI machine after the run. Not killed here: a session fixture may own them on purpose."""
    start = time.time() - 1.0
    yield
    exe = os.path.realpath(sys.executable)
    me = psutil.Process()
    ours = {p.pid for p in me.children(recursive=True)} | {me.pid}
    leaked = []
    for p in psutil.process_iter(["pid", "create_time", "cmdline"]):
        info = p.info
        cmd = info.get("cmdline") or []
        if (info["pid"] not in ours and (info.get("create_time") or 0) >= start and cmd
                and os.path.realpath(cmd[0]) == exe):
            leaked.append(f"{info['pid']}: {' '.join(cmd)[:160]}")
    if leaked:
        warnings.warn(LeakedProcessWarning("processes left running: " + "; ".join(leaked)), stacklevel=1)


@pytest.fixture
def cpu_megatron():
    """Megatron-Core on CPU in this process: compat layer on, 1-rank gloo group, parallel state."""
    from megatron.core import parallel_state

    from mcore_distill import cpu_compat
    from mcore_distill.testing import free_port, init_megatron

    compat = cpu_compat.enable()
    created = False
    saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        created = True
    init_megatron(tp=1, pp=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()
        for k, v in saved_env.items():  # subprocesses of later tests must not inherit this port
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if compat is not None:
            compat.stop()
