"""AWEX 0.9.0 wrapped: capability probe, the Megatron engine's memory hooks on a real Megatron
DDP + distributed optimizer, the colocated writer's init against a real AWEX meta server, and the
bounded-memory colocated transport moving real shards on two gloo ranks with a plan from AWEX's
own TransferPlanBuilder."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mcore_distill.testing import run_ranks

pytest.importorskip("awex", reason="awex is not installed")

from colocate.awex_transport import (  # noqa: E402
    AwexUnavailable,
    awex_capabilities,
    bounded_reader_class,
    colocated_writer_class,
    install_bounded_reader,
    resident_megatron_engine,
)

from ._awex_ranks import bounded_exchange  # noqa: E402


def test_capabilities_are_probed_features():
    caps = awex_capabilities()
    assert {"engine.mcore", "writer.nccl_colocate", "reader.transport_hook", "transport.bounded",
            "plan.builder"} <= caps
    assert ("ipc.cuda" in caps) == torch.cuda.is_available()
    assert ("sglang.hooks" in caps) == (importlib.util.find_spec("sglang") is not None)


def test_install_bounded_reader_is_idempotent_and_undoable():
    import awex.reader.nccl_reader as nr
    from awex.transfer.nccl_bounded_stream import BoundedMemoryNcclColocateStreamBatchTransport

    original = nr.NCCLWorkerWeightsReader
    undo = install_bounded_reader()
    try:
        installed = nr.NCCLWorkerWeightsReader
        assert installed is not original and issubclass(installed, original)
        install_bounded_reader()  # second install keeps the first subclass
        assert nr.NCCLWorkerWeightsReader is installed
        r = object.__new__(installed)
        r.transfer_rank, r.infer_world_size = 0, 1
        assert type(r.create_colocate_transport()) is BoundedMemoryNcclColocateStreamBatchTransport
        assert bounded_reader_class().__mro__[1] is original  # never a subclass of a subclass
    finally:
        undo()
    assert nr.NCCLWorkerWeightsReader is original


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_bounded_transport_moves_shards_on_gloo():
    """Training rows-sharded TP=2 → inference column-sharded TP=2, colocated (process r holds
    training rank r and inference rank r): remote P2P and local copies, routed experts packed."""
    out = run_ranks(bounded_exchange, 2, timeout=100)
    for r in out:
        assert r["transport"] == "BoundedMemoryNcclColocateStreamBatchTransport", r
        assert r["exact"], r  # every received shard bitwise equal to the ground truth
        assert r["remote_ops"] > 0 and r["local_ops"] > 0 and r["packed_wire_ops"] > 0, r


@pytest.mark.timeout(120)
def test_engine_memory_hooks_and_colocated_writer(cpu_megatron, monkeypatch):
    from awex.meta.meta_server import MetaServer, MetaServerClient
    from awex.writer.nccl_writer import NCCLWeightsWriter
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import Qwen3Config

    from colocate import Residency
    from colocate.megatron import megatron_residency_hooks
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, free_port, seed_all

    for k in ("AWEX_META_SERVER_ADDR", "AWEX_META_SERVER_IP", "AWEX_META_SERVER_PORT"):
        monkeypatch.setenv(k, "")  # the engine writes these; restored after the test
    port = free_port()
    server = MetaServer("127.0.0.1", port)
    server.start()
    try:
        seed_all(1)
        m = build_tiny_gpt(TinyGPTConfig(num_layers=1))
        ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(use_distributed_optimizer=True), m)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                     bf16=False, fp16=False), [ddp])
        res = Residency(megatron_residency_hooks([ddp], opt), owner="trainer")
        cfg = {"comm_backend": "nccl", "enable_colocate_mode": True, "meta_server_addr": f"127.0.0.1:{port}",
               "weights_exchange_ipc_backend": "cpu"}
        eng = resident_megatron_engine(cfg, Qwen3Config(architectures=["Qwen3ForCausalLM"]), ddp, residency=res)
        before = {n: p.detach().clone() for n, p in ddp.named_parameters()}

        eng.initialize()  # builds the writer, then (colocated) releases optimizer + weights
        assert res.released == {"optimizer", "weights"}
        writer = eng.weights_exchange_writer
        assert isinstance(writer, NCCLWeightsWriter) and type(writer) is not NCCLWeightsWriter
        eng.release_grad_memory()
        eng.release_memory_occupation("weights")  # AWEX's writers pass a bare string: no-op now
        assert res.released == {"optimizer", "weights", "grads"}
        eng.resume_memory_occupation(tags=["weights"])
        assert res.released == {"optimizer", "grads"}
        assert all(torch.equal(p, before[n]) for n, p in ddp.named_parameters())
        eng.resume_memory_occupation()
        eng.resume_memory_occupation()  # idempotent
        with pytest.raises(ValueError, match="'optimizer' or 'weights'"):
            eng.release_memory_occupation(["kv_cache"])

        # the colocated writer init: AWEX's own class fails on the unset attribute, ours registers
        writer.transfer_rank = 0
        plain = object.__new__(NCCLWeightsWriter)
        plain.__dict__.update(writer.__dict__)
        with pytest.raises(AttributeError, match="asystem_train_config"):
            plain._init_writer_in_colocate_mode()
        writer._init_writer_in_colocate_mode()
        assert writer.ipc_backend == "cpu"
        entries = MetaServerClient("127.0.0.1", port).get_set("training_device_rank_entries")
        assert len(entries) == 1 and next(iter(entries))[2] == 0
        assert colocated_writer_class(type(writer)) is type(writer)
    finally:
        server.stop()


def test_missing_feature_raises_typed_error(monkeypatch):
    import colocate.awex_transport as at

    monkeypatch.setattr(at, "awex_capabilities", lambda: frozenset({"plan.builder"}))
    with pytest.raises(AwexUnavailable, match=r"\['reader.transport_hook', 'transport.bounded'\] not available"):
        bounded_reader_class()
