"""Shared pytest setup: GPU tests skip without CUDA (the GPU lane runs them with -m gpu)."""

from __future__ import annotations

import os

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
