"""GPU lane: CUDA IPC publish into an embedded engine in another process; bf16; residency.

Run: ``pytest -m gpu tests/colocate/test_publish_gpu.py`` on a CUDA machine (≈1 min)."""

from __future__ import annotations

import pytest
import torch

from colocate import EngineConfig, HFModelSpec, PublishConfig
from colocate.buckets import tensor_checksum
from colocate.engines import HFEngine, build_hf_model, hf_checkpoint_views
from colocate.publish import Publisher
from colocate.transports import spawn_receiver

pytestmark = pytest.mark.gpu

SPEC = HFModelSpec(arch="qwen3_moe", num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                   head_dim=64, ffn_hidden_size=512, vocab_size=1024, num_experts=4, rope_theta=10000.0)


def _weights(seed, device="cuda"):
    torch.manual_seed(seed)
    m = build_hf_model(SPEC, dtype=torch.bfloat16, device=device)
    return {n: v.detach().clone() for n, v in hf_checkpoint_views(m).items()}


@pytest.mark.timeout(300)
def test_cuda_ipc_publish_to_engine_process():
    recv = spawn_receiver(HFEngine, SPEC, EngineConfig(device="cuda", dtype="bfloat16"), timeout_s=120)
    try:
        pub = Publisher(recv, PublishConfig(transport="auto", bucket_bytes=1 << 20, max_in_flight=2))
        assert pub.transport == "cuda_ipc"
        w1 = _weights(1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        rep = pub.publish(w1, version=1)
        assert rep.handles == 2 and rep.num_buckets > 4, rep
        assert torch.cuda.max_memory_allocated() - base <= 2 * (1 << 20) + (64 << 20)  # staging, not a model copy
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w1.items()}
        w2 = _weights(2)
        assert pub.publish(w2, version=2).handles == 0
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w2.items()}
        recv.call("release_memory", None)
        recv.call("resume_memory", None)
        assert pub.publish(w2, version=3).version == 3
        ids = [[1, 2, 3, 4, 5]]
        out = recv.call("generate", ids, timeout=120)
        assert len(out.tokens[0]) == 16
        pub.release_staging()
        torch.cuda.ipc_collect()
    finally:
        recv.close()


@pytest.mark.timeout(300)
def test_megatron_gpu_to_embedded_engine_logits():
    from colocate.engines import HFEngine as Engine
    from mcore_distill.testing import run_ranks

    from ._ranks import megatron_hf_weights

    for case in ({"id": "dense"}, {"id": "moe", "experts": 4, "tied": True}):
        got = run_ranks(megatron_hf_weights, 1, case, backend="nccl", timeout=240)[0]
        spec, weights = got["spec"], got["weights"]
        eng = Engine(spec, EngineConfig(device="cuda", dtype="float32"))
        pub = Publisher(eng, PublishConfig(bucket_bytes=1 << 20))
        pub.publish({n: t.cuda() for n, t in weights.items()}, version=1)
        ids = got["tokens"].cuda()
        # fp32 on GPU (TF32 off by default for matmuls): Megatron and HF differ by kernel order only
        assert (eng.logits(ids).cpu() - got["logits"]).abs().max().item() <= 1e-4, case
        assert all(torch.equal(eng.read(n).cpu(), t) for n, t in weights.items())


@pytest.mark.timeout(300)
def test_trainer_residency_returns_device_memory():
    from mcore_distill.testing import run_ranks

    from ._ranks import trainer_residency_gpu

    got = run_ranks(trainer_residency_gpu, 1, backend="nccl", timeout=240)[0]
    assert got["equal"], "training after release/resume differs from the run that never released"
    assert got["freed"] > 500 << 20, got  # ~55M params: fp32 weights + grads + Adam state
    assert got["gain"] >= 0.9 * got["freed"], got  # the memory really went back to the device


@pytest.mark.timeout(300)
def test_cuda_ipc_inplace_storage_is_unmapped_after_publish():
    """In place over CUDA IPC: a DDP-like buffer crosses as one handle, only the separate tensors
    are packed; the receiver unmaps the buffer after the publish, so freeing it on the trainer
    side really returns its memory (no IPC limbo), and the receiver holds the exact bytes."""
    recv = spawn_receiver(HFEngine, SPEC, EngineConfig(device="cuda", dtype="bfloat16"), timeout_s=120)
    try:
        pub = Publisher(recv, PublishConfig(transport="auto", bucket_bytes=1 << 20), share_min_bytes=1 << 20)
        w = _weights(3)
        names = list(w)
        # ≥ 32 MiB: its own allocator segment, so freeing it must show in memory_reserved
        flat = torch.empty(max(sum(w[n].numel() for n in names[2:]), 16 << 20), dtype=torch.bfloat16, device="cuda")
        inplace, off = {n: w[n] for n in names[:2]}, 0
        for n in names[2:]:
            inplace[n] = flat[off: off + w[n].numel()].view(w[n].shape).copy_(w[n])
            off += w[n].numel()
        rep = pub.publish(inplace, version=1)
        assert rep.num_shared == 1 and rep.num_buckets == 1 and rep.handles == 2, rep
        assert recv.checksums() == {n: tensor_checksum(t) for n, t in w.items()}
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        nbytes = flat.numel() * 2
        del inplace, flat
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() <= reserved - nbytes, "the shared buffer stayed in IPC limbo"
    finally:
        recv.close()


@pytest.mark.timeout(300)
def test_cuda_ipc_replay_carries_each_steps_values():
    """Replay over CUDA IPC: a DDP-like buffer and a ConversionArena on the GPU, kept mapped;
    after the first publish the stream is never read, the arena's q/k/v copies re-run on the
    device, and the engine process holds the trainer's current bytes after every step."""
    from colocate.convert import ConversionArena, hf_param_specs, megatron_to_hf

    from .test_convert_arena import DENSE, _buffer

    flat, params = _buffer(DENSE, torch.float32, seed=11, device="cuda")
    arena = ConversionArena.for_spec(DENSE, dtype=torch.float32, device="cuda")
    meta = hf_param_specs(DENSE, dtype=torch.float32)

    def stream(arena=arena):
        if arena is not None:
            arena.reset()
        for n, t in params.items():
            yield from megatron_to_hf(n, t, spec=DENSE, arena=arena)

    def never():
        raise AssertionError("stream read during a replay")
        yield

    recv = spawn_receiver(HFEngine, DENSE, EngineConfig(device="cuda", dtype="float32"), timeout_s=120)
    try:
        pub = Publisher(recv, PublishConfig(transport="auto", verify="none"), share_min_bytes=1, keep_shared=True,
                        replay_sources=[flat], arena=arena)
        first = pub.publish(stream(), version=1, meta=meta)
        assert pub.transport == "cuda_ipc" and not first.replayed and first.num_shared == 2, first
        for version in (2, 3):
            flat.mul_(-0.5).add_(0.125)
            rep = pub.publish(never(), version=version, meta=meta)
            assert rep.replayed and rep.handles == 0 and rep.num_buckets == 0, rep
            assert recv.checksums() == {n: tensor_checksum(t) for n, t in stream(None)}
        pub.release_staging()
    finally:
        recv.close()
