"""CUDA allocator snapshot of one training iteration (issue #24 item 4).

CPU: when recording starts and stops, where the file goes, typed errors. GPU lane: a real
Megatron training step on one GPU writes a valid snapshot (pickle loads, has segments and an
allocation trace that covers the forward/backward, renders with torch's memory_viz).
"""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from mcore_distill.testing import run_ranks
from optim_staged import SlotConfig, StagedAdamW
from optim_staged.config import MemorySnapshotConfig, StagedConfigError, StagedOptimizerConfig
from optim_staged.memory import AllocatorSnapshot, last_torch_optimizer


@pytest.mark.parametrize("kwargs,match", [
    (dict(step=0), "MemorySnapshotConfig.step=0"),
    (dict(max_entries=0), "MemorySnapshotConfig.max_entries=0"),
    (dict(output_dir=3), "MemorySnapshotConfig.output_dir"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(StagedConfigError, match=match):
        MemorySnapshotConfig(**kwargs)


def test_snapshot_needs_cuda_and_a_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StagedConfigError, match="needs CUDA"):
        AllocatorSnapshot(MemorySnapshotConfig(output_dir=str(tmp_path)))
    with pytest.raises(StagedConfigError, match="output_dir=''"):
        AllocatorSnapshot(MemorySnapshotConfig())
    assert StagedOptimizerConfig().memory_snapshot.output_dir == ""  # off by default


@pytest.mark.parametrize("step", [1, 2, 3])
def test_records_exactly_iteration_step(tmp_path, monkeypatch, step):
    """Recording starts after optimizer step ``step - 1`` (at attach for step 1) and the file is
    written after step ``step``, once; the history is switched off again."""
    events: list[tuple[str, int]] = []  # (what, optimizer steps completed when it happened)
    p = torch.zeros(10, requires_grad=True)
    opt = StagedAdamW([p], slots=SlotConfig(slot_numel=1024))
    done = lambda: opt.param_groups[0]["step"]  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: events.append(("start" if enabled else "stop", done())))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot",
                        lambda: (events.append(("snapshot", done())), {"segments": [1], "device_traces": []})[1])
    snap = AllocatorSnapshot(MemorySnapshotConfig(output_dir=str(tmp_path / "run"), step=step), rank=3)
    snap.attach(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=torch.optim.SGD([p], lr=0.1)),
                                                    SimpleNamespace(optimizer=opt)]))
    for _ in range(5):
        p.grad = torch.ones(10)
        opt.step()
    assert events == [("start", step - 1), ("snapshot", step), ("stop", step)]
    assert snap.written == tmp_path / "run" / f"optim_staged_alloc_step{step}_rank3.pickle"
    assert pickle.loads(snap.written.read_bytes()) == {"segments": [1], "device_traces": []}
    assert sorted(os.listdir(tmp_path / "run")) == [snap.written.name]  # atomic: no temporary left


def test_last_torch_optimizer_walks_nested_chains():
    a, b = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)
    chain = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=a),
                                                SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=b)])])
    assert last_torch_optimizer(chain) is b
    with pytest.raises(StagedConfigError, match="holds no torch optimizer"):
        last_torch_optimizer(SimpleNamespace())


def snapshot_body(rank: int, world_size: int, out_dir: str):
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, init_megatron, seed_all
    from optim_staged.config import AdamWConfig
    from optim_staged.megatron import get_staged_optimizer
    from tests.optim_staged.ckpt_faults import train

    init_megatron(tp=1, pp=1, seed=3)
    seed_all(3)
    gpt = build_tiny_gpt(TinyGPTConfig(params_dtype=torch.bfloat16)).cuda()
    model = Float16Module(gpt.config, gpt)
    model = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
                model)
    model.config.finalize_model_grads_func = finalize_model_grads
    cfg = StagedOptimizerConfig(adamw=AdamWConfig(impl="fused"), slots=SlotConfig(slot_numel=1 << 14),
                                memory_snapshot=MemorySnapshotConfig(output_dir=out_dir, step=2))
    optim = get_staged_optimizer(cfg, [model])
    train(model, optim, range(3))
    return str(optim.memory_snapshot.written)


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_allocator_snapshot_of_a_megatron_training_step(tmp_path):
    """One GPU, Megatron GPT (bf16, DDP, staged AdamW distributed optimizer), 3 iterations with
    ``memory_snapshot.step=2``: one file, a valid snapshot of iteration 2."""
    (written,) = run_ranks(snapshot_body, 1, str(tmp_path), backend="nccl", timeout=240)
    assert written == str(tmp_path / "optim_staged_alloc_step2_rank0.pickle")
    assert sorted(os.listdir(tmp_path)) == ["optim_staged_alloc_step2_rank0.pickle"]
    with open(written, "rb") as f:
        snap = pickle.load(f)
    assert isinstance(snap, dict) and snap["segments"], "no allocator segments"
    assert all("address" in s and "total_size" in s and "blocks" in s for s in snap["segments"])
    traces = [e for dev in snap["device_traces"] for e in dev]
    allocs = [e for e in traces if e["action"] == "alloc"]
    assert allocs, "no allocation recorded during iteration 2"
    frames = " ".join(fr["filename"] for e in allocs for fr in e.get("frames", []))
    assert "megatron" in frames, "the record does not cover the forward/backward"
    from torch.cuda import _memory_viz

    assert "<html" in _memory_viz.trace_plot(snap).lower()  # what pytorch.org/memory_viz renders
