"""Residency state machine: idempotence, order, busy refusal, sync-before-release, bytes logged,
storage offload keeping tensor identity, and the trainer hooks on a real Megatron DDP model."""

from __future__ import annotations

import pytest
import torch

from colocate import BusyError, NotResidentError, Residency
from colocate.residency import TensorOffload


def _machine(log, syncs):
    def hook(tag, op, n):
        def f():
            log.append((op, tag))
            return n
        return f

    hooks = {t: (hook(t, "release", i + 1), hook(t, "resume", 10 * (i + 1))) for i, t in enumerate(("kv_cache", "weights", "cuda_graph"))}
    return Residency(hooks, owner="eng", sync=lambda: syncs.append(len(log)))


def test_idempotent_ordered_and_logged():
    log, syncs = [], []
    r = _machine(log, syncs)
    assert r.release(["cuda_graph", "kv_cache"]) == {"kv_cache": 1, "cuda_graph": 3}
    assert log == [("release", "kv_cache"), ("release", "cuda_graph")]
    assert syncs == [0]  # synchronized before the first release hook ran
    assert r.release(["kv_cache"]) == {} and r.release(["cuda_graph", "kv_cache"]) == {}
    assert r.release() == {"weights": 2}
    assert r.released == {"kv_cache", "weights", "cuda_graph"}
    assert r.resume() == {"cuda_graph": 30, "weights": 20, "kv_cache": 10}
    assert log[-3:] == [("resume", "cuda_graph"), ("resume", "weights"), ("resume", "kv_cache")]
    assert r.resume() == {} and r.resume(["weights"]) == {}
    assert [(e.op, e.tag, e.nbytes) for e in r.events][:2] == [("release", "kv_cache", 1), ("release", "cuda_graph", 3)]
    with pytest.raises(ValueError, match=r"unknown residency tag\(s\) \['kv'\]"):
        r.release(["kv"])


def test_release_while_busy_is_refused_and_busy_needs_residency():
    log, syncs = [], []
    r = _machine(log, syncs)
    with r.busy():
        with pytest.raises(BusyError, match="refused while busy"):
            r.release(["kv_cache"])
        assert r.release([]) == {}
    assert not r.released and log == []
    r.release(["weights"])
    with pytest.raises(NotResidentError, match=r"needs \['weights'\] resident"):
        with r.busy():
            pass
    r.resume(["weights"])
    with r.busy():
        pass


def test_tensor_offload_keeps_identity_views_and_contents():
    flat = torch.randn(64, dtype=torch.float64)
    view = flat[8:24].view(4, 4)
    keep = TensorOffload(lambda: [flat], keep_contents=True)
    before = flat.clone()
    assert keep.release() == 64 * 8
    assert flat.untyped_storage().nbytes() == 0
    assert keep.resume() == 64 * 8
    assert torch.equal(flat, before) and torch.equal(view, before[8:24].view(4, 4))
    drop = TensorOffload(lambda: [flat, view], keep_contents=False)  # shared storage counted once
    assert drop.release() == 64 * 8
    drop.resume()
    assert torch.count_nonzero(flat) == 0 and view.data_ptr() == flat.data_ptr() + 8 * 8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optim", ["megatron-adam", "optim_staged"])
def test_megatron_trainer_cycle_restores_training_exactly(cpu_megatron, optim):
    """Release optimizer, grads, weights of a real DDP + distributed-optimizer model, resume,
    and continue: the next step equals a run that never released (Megatron's Adam, and the
    host-staged AdamW of ``optim_staged`` on a bf16 model)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from colocate.megatron import megatron_residency_hooks
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all

    def step(model, opt, tokens):
        model.zero_grad_buffer()
        opt.zero_grad()
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        model(tokens, pos, None, labels=tokens).float().mean().backward()
        model.finish_grad_sync()
        opt.step()

    def run(release: bool):
        seed_all(3)
        if optim == "optim_staged":
            staged = pytest.importorskip("optim_staged.megatron")
            from optim_staged.config import AdamWConfig, SlotConfig, StagedOptimizerConfig

            m = build_tiny_gpt(TinyGPTConfig(num_layers=1, params_dtype=torch.bfloat16))
            m = Float16Module(m.config, m)
            ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True), m)
            opt = staged.get_staged_optimizer(StagedOptimizerConfig(
                residency="staged", adamw=AdamWConfig(lr=1e-2, impl="foreach"),
                slots=SlotConfig(slot_numel=3000, num_slots=2)), [ddp])
        else:
            m = build_tiny_gpt(TinyGPTConfig(num_layers=1))
            ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(use_distributed_optimizer=True), m)
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                         bf16=False, fp16=False), [ddp])
        tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
        step(ddp, opt, tokens)
        freed = {}
        if release:
            res = Residency(megatron_residency_hooks([ddp], opt), owner="trainer")
            freed = res.release()
            assert res.release() == {}
            assert all(b.param_data.untyped_storage().nbytes() == 0 for b in ddp.buffers)
            restored = res.resume()
            assert restored["weights"] == freed["weights"]
        step(ddp, opt, tokens)
        return {n: p.detach().clone() for n, p in ddp.named_parameters()}, freed

    ref, _ = run(False)
    out, freed = run(True)
    assert set(freed) == {"optimizer", "grads", "weights"} and freed["weights"] > 0 and freed["grads"] > 0
    if optim == "megatron-adam":
        assert freed["optimizer"] > 0  # on CPU the staged optimizer holds no accelerator state
    for n in ref:
        assert torch.equal(ref[n], out[n]), n

