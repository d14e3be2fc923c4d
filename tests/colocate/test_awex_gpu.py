"""GPU lane: AWEX's bounded-memory colocated transport (selected through our reader subclass)
over NCCL with CUDA tensors, one process per GPU; needs 2 GPUs (NCCL refuses two ranks on one
device, so a one-GPU machine cannot run a colocated NCCL exchange)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("awex", reason="awex is not installed")


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2): NCCL needs one device per rank")
def test_bounded_transport_nccl_two_gpus():
    import torch.multiprocessing as mp

    from mcore_distill.testing import free_port

    from ._awex_ranks import nccl_main

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=nccl_main, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    for r, res in results.items():
        assert "error" not in res, (r, res)
        assert res["transport"] == "BoundedMemoryNcclColocateStreamBatchTransport" and res["exact"], (r, res)
        assert res["remote_ops"] > 0 and res["local_ops"] > 0 and res["packed_wire_ops"] > 0, (r, res)
