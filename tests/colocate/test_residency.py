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


def _optimizer_case(case: str):
    """A tiny DDP model and the optimizer of ``case`` (bf16 model under Megatron's distributed
    optimizer; staged Muon under Megatron's FP32Optimizer / Float16Optimizer wrappers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all

    seed_all(3)
    bf16 = case in ("bf16-distopt", "muon-bf16")
    m = build_tiny_gpt(TinyGPTConfig(num_layers=1, params_dtype=torch.bfloat16 if bf16 else torch.float32))
    if bf16:
        m = Float16Module(m.config, m)
    distopt = case == "bf16-distopt"
    ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distopt), m)
    if distopt:
        return ddp, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                           bf16=True, params_dtype=torch.bfloat16), [ddp])
    staged = pytest.importorskip("optim_staged.megatron")
    from optim_staged.config import AdamWConfig, MuonConfig, SlotConfig, StagedOptimizerConfig

    return ddp, staged.get_staged_optimizer(StagedOptimizerConfig(
        algorithm="muon", residency="staged", muon=MuonConfig(lr=0.02, tp_mode="duplicated"),
        adamw=AdamWConfig(impl="foreach"), slots=SlotConfig(slot_numel=1 << 14, num_slots=2)), [ddp])


def _train_step(model, opt, tokens) -> None:
    model.zero_grad_buffer()
    opt.zero_grad()
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    model(tokens, pos, None, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    opt.step()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["bf16-distopt", "muon-fp32", "muon-bf16"])
def test_optimizer_tag_releases_what_the_optimizer_owns(cpu_megatron, case):
    """The ``optimizer`` tag takes everything the optimizer holds outside the model's buffers:
    with Megatron's distributed optimizer and a bf16 model, the fp32 master shards as well as the
    moments; with staged Muon (under Megatron's FP32Optimizer / Float16Optimizer wrappers) the
    GPU slots are drained and the host slabs are left alone (not resized, not counted as freed),
    while a bf16 model's fp32 main params go. Training then continues bit for bit."""
    from colocate.megatron import megatron_residency_hooks

    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    ref_model, ref_opt = _optimizer_case(case)
    for _ in range(2):
        _train_step(ref_model, ref_opt, tokens)

    ddp, opt = _optimizer_case(case)
    _train_step(ddp, opt, tokens)
    leaves = opt.chained_optimizers
    if case == "bf16-distopt":
        masters = [p for leaf in leaves for g in leaf.shard_fp32_from_float16_groups for p in g]
        moments = [v for leaf in leaves for st in leaf.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.numel() > 1]
        slabs = []
    else:
        assert {type(leaf.optimizer).__name__ for leaf in leaves} == {"StagedMuon", "StagedAdamW"}
        masters = [p for leaf in leaves for g in getattr(leaf, "fp32_from_float16_groups", []) for p in g]
        moments = []
        slabs = [v for leaf in leaves for st in leaf.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        assert all(leaf.optimizer._ring.allocated_bytes > 0 for leaf in leaves)  # the step left slots allocated
    assert bool(masters) == (case != "muon-fp32")
    owned = sum(t.untyped_storage().nbytes() for t in masters + moments)
    slab_bytes = [v.untyped_storage().nbytes() for v in slabs]
    weight_bytes = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in ddp.parameters()}.values())

    res = Residency(megatron_residency_hooks([ddp], opt), owner="trainer")
    freed = res.release()
    assert freed["optimizer"] == owned, (freed, owned)  # on CPU the staged slots are no accelerator bytes
    assert all(t.untyped_storage().nbytes() == 0 for t in masters + moments)
    assert [v.untyped_storage().nbytes() for v in slabs] == slab_bytes  # host state untouched
    if slabs:
        assert all(leaf.optimizer._ring.allocated_bytes == 0 for leaf in leaves)  # slots drained and freed
    assert freed["weights"] == weight_bytes > 0  # parameters outside a param buffer (no distributed optimizer) too
    assert all(p.untyped_storage().nbytes() == 0 for p in ddp.parameters())
    res.resume()
    _train_step(ddp, opt, tokens)
    for (n, a), b in zip(ref_model.named_parameters(), ddp.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_allocator_configuration_is_logged(monkeypatch, caplog):
    from colocate.residency import allocator_config

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert allocator_config() == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert allocator_config({}) == "default"
    log, syncs = [], []
    with caplog.at_level("INFO", logger="colocate.residency"):
        r = _machine(log, syncs)
        r.release(["weights"])
    assert "eng: release weights" in caplog.text and "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" \
        in caplog.text
    assert r.events[-1].allocator == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    other = Residency({"kv_cache": (lambda: 0, lambda: 0)}, owner="sglang", sync=lambda: None, allocator="default")
    with caplog.at_level("INFO", logger="colocate.residency"):
        other.release()
    assert "sglang: release kv_cache 0.0 MiB" in caplog.text and "(allocator: default)" in caplog.text
