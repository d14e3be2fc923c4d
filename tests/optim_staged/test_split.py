"""StagedAdamW's host/slot split, gradient offload, parameter-as-master and bf16 moments, on CPU
(the host lane, the slot ring and the gradient hooks run the same code as on CUDA, with
synchronous copies)."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_distill.testing import assert_close
from optim_staged import SlotConfig, StagedAdamW, StagedConfigError
from optim_staged.adamw import merge_units
from optim_staged.reference import reference_adamw_step
from optim_staged.slabs import Piece, Unit

SHAPES = [(7, 13), (1031,), (3, 5, 11), (64, 33), (1,), (2500,)]
SLOTS = SlotConfig(slot_numel=1024, num_slots=2)


def _grads(g, shapes, dtype=torch.float32):
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


def _torch_vs_staged(staged_kwargs, torch_kwargs, *, steps=8, offload=False, dtype=torch.float32, seed=0):
    """torch.optim.AdamW and StagedAdamW on the same parameters and gradients; gradients reach the
    staged optimizer through autograd (``(p * g).sum().backward()``) so the offload hooks fire."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    ref = [p.clone().float().requires_grad_() for p in init]
    out = [p.clone().requires_grad_() for p in init]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, **torch_kwargs)
    o_out = StagedAdamW(out, lr=1e-2, weight_decay=0.1, slots=SLOTS, offload_gradients=offload, **staged_kwargs)
    for s in range(steps):
        if s == 5:  # LR / WD changes between steps take effect on both lanes (set before the backward
            for o in (o_ref, o_out):  # pass: with offload_gradients the update runs during it)
                for grp in o.param_groups:
                    grp["lr"] *= 0.5
                    grp["weight_decay"] = 0.02
        grads = _grads(g, SHAPES)
        for a, gr in zip(ref, grads):
            a.grad = gr.clone()
        sum((b * gr.to(dtype)).sum() for b, gr in zip(out, grads)).backward()
        if offload:
            assert all(b.grad is None for b in out)  # freed on the device by the hooks
        o_ref.step()
        o_out.step()
        o_out.zero_grad()
    o_out.drain(release=False)
    return ref, out, o_ref, o_out


def _assert_matches_torch(ref, out, o_ref, o_out, rtol):
    for i, (a, b) in enumerate(zip(ref, out)):
        assert_close(f"param{i}", a, b.float(), atol=0, rtol=rtol)
        st = o_out.state[b]
        assert_close(f"master{i}", a, st["master_param"], atol=0, rtol=rtol)
        assert_close(f"exp_avg{i}", o_ref.state[a]["exp_avg"], st["exp_avg"], atol=0, rtol=rtol)
        assert_close(f"exp_avg_sq{i}", o_ref.state[a]["exp_avg_sq"], st["exp_avg_sq"], atol=1e-12, rtol=rtol)


@pytest.mark.parametrize("host_fraction", [0.0, 0.3, 0.6, 1.0])
@pytest.mark.parametrize("offload", [False, True], ids=["grads_on_device", "offload_gradients"])
def test_every_split_matches_torch_foreach(host_fraction, offload):
    ref, out, o_ref, o_out = _torch_vs_staged(dict(host_fraction=host_fraction, impl="foreach"),
                                              dict(foreach=True), offload=offload)
    res = o_out.residency
    assert res["param_is_master"] and res["offload_gradients"] == offload
    if 0 < host_fraction < 1:
        assert 0 < res["host_numel"] < res["staged_numel"]
    _assert_matches_torch(ref, out, o_ref, o_out, rtol=1e-6)


@pytest.mark.parametrize("offload", [False, True], ids=["grads_on_device", "offload_gradients"])
def test_split_fused_matches_torch_fused(offload):
    # CPU fused kernel: vector tails fall differently on chunk views (1e-6 rel, as test_adamw.py).
    ref, out, o_ref, o_out = _torch_vs_staged(dict(host_fraction=0.5, impl="fused"), dict(fused=True),
                                              offload=offload)
    _assert_matches_torch(ref, out, o_ref, o_out, rtol=1e-6)


def test_host_and_slot_halves_equal_one_lane():
    """The same updates through either lane give the same bits (foreach on one device)."""
    results = []
    for hf in (0.0, 0.5, 1.0):
        _, out, _, o = _torch_vs_staged(dict(host_fraction=hf, impl="foreach"), dict(foreach=True), steps=5)
        results.append([(b.detach().clone(), o.state[b]["exp_avg"].clone(), o.state[b]["exp_avg_sq"].clone())
                        for b in out])
    for other in results[1:]:
        for (p0, m0, v0), (p1, m1, v1) in zip(results[0], other):
            assert torch.equal(p0, p1) and torch.equal(m0, m1) and torch.equal(v0, v1)


def test_auto_balance_moves_the_border_and_stays_exact(monkeypatch):
    """The search follows measured step times; those are replaced by a synthetic cost (host lane
    3x cheaper per element than the slot lane) so the path does not depend on this machine's load."""
    from optim_staged.adamw import StagedAdamW

    real = StagedAdamW._maybe_rebalance

    def synthetic_timing(self):
        if self._timing is not None and self._timing[2] != "cuda":
            host_n, ring_n = self._timing[:2]
            self._timing = (host_n, ring_n, host_n * 1e-9, ring_n * 3e-9)
        return real(self)

    monkeypatch.setattr(StagedAdamW, "_maybe_rebalance", synthetic_timing)
    ref, out, o_ref, o_out = _torch_vs_staged(dict(auto_balance=True, balance_steps=4, impl="foreach"),
                                              dict(foreach=True), steps=9)
    assert o_out._balanced == 4 and len(o_out._tried) >= 3  # four measurements at three or more splits
    best = min(o_out._tried, key=o_out._tried.get)
    assert best == max(o_out._tried)  # the cheaper host lane pulled the border up
    assert abs(o_out.split - best) < 1e-6  # then the fastest measured split is kept
    _assert_matches_torch(ref, out, o_ref, o_out, rtol=1e-6)


def test_bf16_params_with_host_lane_equal_bf16_of_master():
    _, out, _, o = _torch_vs_staged(dict(host_fraction=0.5), dict(fused=True), dtype=torch.bfloat16, offload=True)
    assert not o.residency["param_is_master"]  # bf16 params: the master streams with the moments
    for i, p in enumerate(out):
        assert torch.equal(p.detach(), o.state[p]["master_param"].to(torch.bfloat16)), f"param{i}"


def test_offload_gradients_rejects_accumulation_and_skips_params_without_grad():
    ps = [torch.randn(s).requires_grad_() for s in SHAPES]
    opt = StagedAdamW(ps, lr=1e-2, slots=SLOTS, offload_gradients=True, host_fraction=0.5)
    opt.initialize_state()
    sum(p.sum() for p in ps).backward()
    with pytest.raises(StagedConfigError, match="gradient accumulation"):
        ps[0].sum().backward()
    opt.step()
    # Only ps[1] gets a gradient: every other parameter and its moments stay as they are.
    opt.drain(release=False)
    before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone()) for p in ps]
    (ps[1] * 2).sum().backward()
    opt.step()
    opt.drain(release=False)
    for i, (p, (p0, m0)) in enumerate(zip(ps, before)):
        changed = not torch.equal(p.detach(), p0) or not torch.equal(opt.state[p]["exp_avg"], m0)
        assert changed == (i == 1), i


def test_param_is_master_state_access():
    """fp32 params: the host master follows the slot-lane updates after drain(), and writes of
    the master through the precision-aware contract or a state dict reach the parameter."""
    ref, out, o_ref, o_out = _torch_vs_staged(dict(host_fraction=0.4, impl="foreach"), dict(foreach=True), steps=3)
    for b in out:
        assert torch.equal(o_out.get_unscaled_state(b, "master_param"), b.detach())
    o_out.set_scaled_state(out[0], "master_param", torch.full(out[0].shape, 0.25))
    assert torch.equal(out[0].detach(), torch.full(out[0].shape, 0.25))
    sd = o_out.state_dict()
    sd = {"state": {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                    for k, v in sd["state"].items()}, "param_groups": [dict(x) for x in sd["param_groups"]]}
    fresh_params = [torch.zeros_like(p).requires_grad_() for p in out]
    fresh = StagedAdamW(fresh_params, lr=1.0, slots=SlotConfig(slot_numel=2048), host_fraction=0.7, impl="foreach")
    fresh.load_state_dict(sd)
    for a, b in zip(out, fresh_params):
        assert torch.equal(a.detach(), b.detach())  # the loaded master is the parameter
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        for a, b in zip(out, fresh_params):
            gr = torch.randn(a.shape, generator=g)
            a.grad, b.grad = gr.clone(), gr.clone()
        o_out.step()
        fresh.step()
    for a, b in zip(out, fresh_params):
        assert torch.equal(a.detach(), b.detach())


def test_bytes_per_step_and_merge():
    ps = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    n = sum(p.numel() for p in ps)
    opt = StagedAdamW(ps, slots=SLOTS, host_fraction=0.5)
    b = opt.bytes_per_step()
    assert b["host_numel"] + b["ring_numel"] == n
    assert b["h2d"] == 8 * b["ring_numel"] + 4 * b["host_numel"] == b["d2h"]  # fp32 params: moments only
    off = StagedAdamW([p.detach().clone().requires_grad_() for p in ps], slots=SLOTS, offload_gradients=True,
                      host_fraction=0.0)
    b = off.bytes_per_step()
    assert b["h2d"] == 8 * n and b["d2h"] == 8 * n  # slot-lane gradients are consumed on the device
    bf = StagedAdamW([p.detach().to(torch.bfloat16).requires_grad_() for p in ps], slots=SLOTS,
                     exp_avg_dtype="bf16", exp_avg_sq_dtype=torch.bfloat16)
    assert bf.bytes_per_step()["h2d"] == 8 * n  # fp32 master + 2 bf16 moments
    units = [Unit(0, 0, 10, (Piece(0, 0, 10, 0),)), Unit(0, 10, 16, (Piece(0, 10, 2, 0), Piece(1, 0, 4, 2))),
             Unit(1, 16, 20, (Piece(2, 0, 4, 0),))]
    merged = merge_units(units, 100)
    assert [(u.group, u.start, u.end) for u in merged] == [(0, 0, 16), (1, 16, 20)]
    assert merged[0].pieces == (Piece(0, 0, 12, 0), Piece(1, 0, 4, 12))
    assert len(merge_units(units, 10)) == 3


def test_bad_split_config():
    p = [torch.zeros(4, requires_grad=True)]
    with pytest.raises(StagedConfigError, match="host_fraction"):
        StagedAdamW(p, host_fraction=1.5)
    with pytest.raises(StagedConfigError, match="exp_avg_dtype"):
        StagedAdamW(p, exp_avg_dtype="fp16")
    with pytest.raises(StagedConfigError, match="exp_avg_sq_dtype"):
        StagedAdamW(p, exp_avg_sq_dtype=torch.float16)
    with pytest.raises(StagedConfigError, match="host_batch_numel"):
        StagedAdamW(p, host_batch_numel=10)
    with pytest.raises(StagedConfigError, match="leaf parameters that require grad"):
        StagedAdamW([torch.zeros(4)], offload_gradients=True)  # hooks are set up at construction


U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits, round to nearest even)


@pytest.mark.parametrize("host_fraction", [0.0, 0.5])
def test_bf16_moments_within_documented_bound_of_fp64(host_fraction):
    """Moments stored in bf16 vs an fp64 reference on the same gradients.

    Bound (docs/optim_staged.md): each step rounds m and v once to bf16, so the stored moment's
    error obeys |e_t| <= beta |e_{t-1}| + u |m~_t|, i.e. |e_t| <= u * sum_{k<t} beta^k * max_k |m~_k|
    elementwise (u = 2^-8), plus fp32 arithmetic (~1e-6 relative here). The parameter error then
    grows by at most the change of the update lr/bc1 * m/(sqrt(v/bc2) + eps) under those moment
    errors, accumulated over steps; the test evaluates that sum along the run."""
    b1, b2, eps, lr, wd = 0.9, 0.99, 1e-8, 1e-2, 0.1
    g = torch.Generator().manual_seed(7)
    init = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    ref = [p.clone() for p in init]
    ref_state = [{} for _ in ref]
    out = [p.float().requires_grad_() for p in init]
    opt = StagedAdamW(out, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, slots=SLOTS, impl="foreach",
                      host_fraction=host_fraction, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.bfloat16
    maxm = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    maxv = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    p_bound = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    s1 = s2 = 0.0
    for t in range(1, 21):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
        for p, gr in zip(out, grads):
            p.grad = gr.float()
        opt.step()
        reference_adamw_step(ref, grads, ref_state, step=t, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
        opt.drain(release=False)
        s1, s2 = 1 + b1 * s1, 1 + b2 * s2  # sum_{k<t} beta^k
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        for i, p in enumerate(out):
            m, v = (opt.state[p][k].double() for k in ("exp_avg", "exp_avg_sq"))
            mr, vr = ref_state[i]["exp_avg"], ref_state[i]["exp_avg_sq"]
            maxm[i] = torch.maximum(maxm[i], m.abs())
            maxv[i] = torch.maximum(maxv[i], v)
            bm = U_BF16 * s1 * maxm[i] + 1e-6 * mr.abs().max()
            bv = U_BF16 * s2 * maxv[i] + 1e-6 * vr.max()
            assert ((m - mr).abs() <= bm).all(), (t, i, ((m - mr).abs() / bm).max().item())
            assert ((v - vr).abs() <= bv).all(), (t, i, ((v - vr).abs() / bv).max().item())
            # |d update| <= lr/bc1 * (|e_m| / (sqrt(v_lo/bc2) + eps) + |m| |sqrt(v) - sqrt(v_ref)| / (...)^2)
            v_lo = (torch.minimum(v, vr) - 0).clamp_min(0)
            den = (v_lo / bc2).sqrt() + eps
            dsq = (v - vr).abs() / (v.sqrt() + vr.sqrt()).clamp_min(1e-300) / math.sqrt(bc2)
            p_bound[i] = p_bound[i] * (1 - lr * wd) + lr / bc1 * (bm / den + (m.abs() + bm) * dsq / den**2)
    for i, p in enumerate(out):
        err = (p.detach().double() - ref[i]).abs()
        slack = 1e-6 * ref[i].abs() + 1e-7
        assert (err <= p_bound[i] + slack).all(), (i, (err / (p_bound[i] + slack)).max().item())


def _build_megatron(host_fraction: float | None, seed: int = 7):
    """Tiny bf16 GPT (DDP, distributed optimizer); ``host_fraction=None``: native Megatron Adam."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all
    from optim_staged.config import AdamWConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer

    seed_all(seed)
    model = build_tiny_gpt(TinyGPTConfig(num_layers=2, params_dtype=torch.bfloat16))
    model = Float16Module(model.config, model)
    model = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                            use_distributed_optimizer=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    cfg = StagedOptimizerConfig(
        residency="gpu" if host_fraction is None else "staged", clip_grad=0.05,  # clipping active
        adamw=AdamWConfig(lr=2e-3, weight_decay=0.1, impl="foreach", host_fraction=host_fraction or 0.0),
        slots=SlotConfig(slot_numel=3000, num_slots=2))
    return model, get_staged_optimizer(cfg, [model])


def megatron_split_body(rank: int, world_size: int):
    from mcore_distill.testing import init_megatron
    from optim_staged.megatron import staged_leaves
    from tests.optim_staged.test_megatron import _leaf_states, _params, _train_pair

    init_megatron(tp=1, pp=1, seed=7)
    native_model, native = _build_megatron(None)
    staged_model, staged = _build_megatron(0.5)
    inner = staged_leaves(staged)[0].optimizer
    norms = []
    for step in range(3):
        norms.append(_train_pair(native_model, native, staged_model, staged, step, [rank]))
        if step == 1:
            staged.offload_to_cpu()
            staged.restore_from_cpu()
    return {"norms": norms, "residency": inner.residency, "native_states": _leaf_states(native),
            "staged_states": _leaf_states(staged), "native_params": _params(native_model),
            "staged_params": _params(staged_model)}


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_split_in_megatron_dp2_with_clipping_matches_native():
    """DP=2 distributed optimizer, grad-norm clipping active, half of each rank's shard updated on
    the host lane: grad norms, states and bf16 params as native Megatron Adam (same foreach ops on
    CPU, so bitwise)."""
    import numpy as np

    from mcore_distill.testing import run_ranks

    for r in run_ranks(megatron_split_body, 2, timeout=200):
        assert 0 < r["residency"]["host_numel"] < r["residency"]["staged_numel"]
        assert not r["residency"]["param_is_master"]  # bf16 shards: the master is staged
        for n_nat, n_stg in r["norms"]:
            assert n_nat > 0.05 and abs(n_nat - n_stg) <= 1e-6 * n_nat  # above clip_grad: clipped
        for name, st in r["native_states"].items():
            for key in ("param", "exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(r["staged_states"][name][key], st[key], err_msg=f"{name}.{key}")
        for name, ref in r["native_params"].items():
            np.testing.assert_array_equal(r["staged_params"][name], ref, err_msg=name)


def test_set_split_between_steps_stays_exact():
    """Switching lanes, balancing and gradient offload between steps keeps the run exact."""
    g = torch.Generator().manual_seed(11)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in init]
    out = [p.clone().requires_grad_() for p in init]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, foreach=True)
    o_out = StagedAdamW(out, lr=1e-2, slots=SLOTS, impl="foreach")
    plan = [dict(host_fraction=0.5), dict(offload_gradients=True), dict(host_fraction=0.0),
            dict(auto_balance=True), dict(offload_gradients=False, auto_balance=False, host_fraction=1.0)]
    for step in range(10):
        if step % 2 == 0:
            o_out.set_split(**plan[step // 2])
        grads = _grads(g, SHAPES)
        for a, gr in zip(ref, grads):
            a.grad = gr.clone()
        sum((b * gr).sum() for b, gr in zip(out, grads)).backward()
        o_ref.step()
        o_out.step()
        o_out.zero_grad()
    assert o_out.split == 1.0 and not o_out.offload_gradients
    o_out.drain(release=False)
    _assert_matches_torch(ref, out, o_ref, o_out, rtol=1e-6)


def test_offload_updates_during_backward_and_step_finishes():
    """offload_gradients: slot units are updated in the backward pass as soon as all their
    parameters have gradients (a unit holding two whole small parameters waits for both; a unit
    never holds part of a parameter next to another one); host-lane parameters are updated by
    step(); the counters advance once, when the backward pass starts."""
    ps = [torch.randn(s).requires_grad_() for s in ((400,), (500,), (1148,), (3072,))]
    opt = StagedAdamW(ps, lr=1e-2, slots=SLOTS, offload_gradients=True, host_fraction=0.6, impl="foreach")
    units = opt._staged_units
    assert [sorted({pc.param_index for pc in u.pieces}) for u in units] == [[0, 1], [2], [2]]
    assert list(opt._param_host) == [3] and 3 not in opt._param_units  # the last parameter: host lane
    before = [p.detach().clone() for p in ps]
    (ps[0] * 3).sum().backward()  # unit 0 also needs param 1: nothing streams yet
    assert not any(opt._unit_done) and opt.param_groups[0]["step"] == 1  # counters advance at the start
    assert torch.equal(ps[0].detach(), before[0])
    with pytest.raises(StagedConfigError, match="between a backward pass and its step"):
        opt.set_split(0.3)
    (ps[1] * 2).sum().backward()
    assert opt._unit_done == [True, False, False] and not torch.equal(ps[0].detach(), before[0])
    (ps[2] * 2).sum().backward()
    assert all(opt._unit_done)
    (ps[3] * 2).sum().backward()
    assert torch.equal(ps[3].detach(), before[3])  # the host lane runs in step() on CPU
    opt.step()
    assert opt.param_groups[0]["step"] == 1 and not torch.equal(ps[3].detach(), before[3])
    ref = [b.clone().requires_grad_() for b in before]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, foreach=True)
    for r, c in zip(ref, (3.0, 2.0, 2.0, 2.0)):
        r.grad = torch.full_like(r, c)
    o_ref.step()
    for a, b in zip(ref, ps):
        assert torch.equal(a.detach(), b.detach())


def test_whole_param_units_cover_the_slabs():
    from optim_staged.slabs import build_units

    numels = [1000, 1048, 3072, 500, 9000, 10, 7, 2048]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    groups = [0] * 5 + [1] * 3
    for whole in (False, True):
        units = build_units(numels, offsets, groups, slot_numel=2048, whole_params=whole)
        assert units[0].start == 0 and units[-1].end == sum(numels)
        assert all(a.end == b.start for a, b in zip(units, units[1:])) and all(u.numel <= 2048 for u in units)
        for u in units:
            assert sum(pc.numel for pc in u.pieces) == u.numel and len({groups[pc.param_index] for pc in u.pieces}) == 1
            if whole and len(u.pieces) > 1:  # several params: all whole
                assert all(pc.p_start == 0 and pc.numel == numels[pc.param_index] for pc in u.pieces)


@pytest.mark.parametrize("host_fraction", [0.0, 0.3])
def test_offload_prefetch_of_the_next_gradient_is_exact(host_fraction):
    """offload_gradients: each hook starts the H2D of the slot units of the parameter expected
    next (the previous step's arrival order). A right guess makes every slot unit load once per
    step (the prefetched slots are hit, not reloaded); a wrong guess (the arrival order changes
    at step 4) only reloads. Bitwise vs torch's foreach AdamW throughout."""
    from optim_staged.slabs import SlotRing

    shapes = [(900,), (33, 31), (2048,), (700,), (1500,), (3000,)]
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=g) for s in shapes]
    ref = [p.clone().requires_grad_() for p in init]
    out = [p.clone().requires_grad_() for p in init]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=True)
    opt = StagedAdamW(out, lr=1e-2, weight_decay=0.1, slots=SLOTS, offload_gradients=True,
                      host_fraction=host_fraction, impl="foreach")
    loads, prefetches = [0], [0]
    orig_load, orig_prefetch = SlotRing._load, SlotRing.prefetch

    def count_load(self, *a, **k):
        loads[0] += 1
        return orig_load(self, *a, **k)

    def count_prefetch(self, *a, **k):
        prefetches[0] += 1
        return orig_prefetch(self, *a, **k)

    n_units = len(opt._staged_units)
    assert n_units >= 4 and (host_fraction == 0) == (not opt._host_units)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SlotRing, "_load", count_load)
        mp.setattr(SlotRing, "prefetch", count_prefetch)
        for step in range(7):
            grads = _grads(g, shapes)
            for a, gr in zip(ref, grads):
                a.grad = gr.clone()
            order = list(range(len(shapes)))[::-1] if step < 4 else [1, 4, 0, 5, 2, 3]
            loads[0] = prefetches[0] = 0
            for i in order:  # one backward pass per parameter: the arrival order is ours
                (out[i] * grads[i]).sum().backward()
            o_ref.step()
            opt.step()
            if 1 <= step < 4:  # the order of the previous step repeats: every guess is right
                assert prefetches[0] > 0 and loads[0] == n_units, (step, loads[0], n_units)
    opt.drain(release=False)
    for i, (a, b) in enumerate(zip(ref, out)):
        assert torch.equal(a.detach(), b.detach()), i
        assert torch.equal(o_ref.state[a]["exp_avg"], opt.state[b]["exp_avg"]), i
        assert torch.equal(o_ref.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"]), i


def test_offload_plan_bounds_slots_plus_one_gradient():
    """offload_plan: the host lane takes the shortest suffix of parameters that leaves slots with
    slot-lane gradient + slots <= the largest gradient - margin; slot sizes are multiples of 64 Ki."""
    numels = [1 << 18, 1 << 19, 3 << 19, 1 << 21, 5 << 20]  # 0.25, 0.5, 1.5, 2, 5 Mi
    ps = [torch.zeros(n, requires_grad=True) for n in numels]
    opt = StagedAdamW(ps, slots=SlotConfig(slot_numel=4 << 20, num_slots=3), offload_gradients=True)
    share, slots = opt.offload_plan(min_slot_numel=64 << 10, margin_bytes=0)
    # largest gradient 20 MiB; slots 3 x n x 8 B (fp32 params: moments only). With the 5 Mi param on
    # the host: 20 MiB - 8 MiB = 12 MiB -> n = 512 Ki (a multiple of 64 Ki)
    assert share == pytest.approx((5 << 20) / sum(numels))
    assert slots.slot_numel == 512 << 10 and slots.num_slots == 3
    assert max(n * 4 for n in numels[:4]) + 3 * slots.slot_numel * 8 <= 4 * numels[-1]
    share2, slots2 = opt.offload_plan(min_slot_numel=1 << 20, margin_bytes=0, num_slots=2)
    # 2 slots of >= 1 Mi take >= 16 MiB: only gradients of <= 4 MiB may stay in the slot lane, so the
    # 1.5, 2 and 5 Mi params (6, 8, 20 MiB of gradient) go to the host lane
    assert share2 == pytest.approx(sum(numels[2:]) / sum(numels)) and slots2.slot_numel >= 1 << 20
    assert max(n * 4 for n in numels[:2]) + 2 * slots2.slot_numel * 8 <= 4 * numels[-1]
    assert opt.offload_plan(bound_bytes=1 << 10)[0] == 1.0  # nothing fits: all on the host lane
    opt.set_slot_config(slots)
    opt.set_split(share)
    assert opt._host_units and {pc.param_index for u in opt._host_units for pc in u.pieces} == {4}
    with pytest.raises(StagedConfigError, match="host_threads"):
        StagedAdamW([torch.zeros(4)], host_threads=0)


def test_offload_prefetch_allocates_no_slots_under_a_host_lane_gradient():
    """The hook prefetch does not allocate the slots while the next gradient expected is a host-lane
    one (offload_plan's bound: slots share a peak only with slot-lane gradients)."""
    shapes = [(900,), (2048,), (3000,), (5000,)]
    ps = [torch.randn(s).requires_grad_() for s in shapes]
    opt = StagedAdamW(ps, lr=1e-2, slots=SLOTS, offload_gradients=True, host_fraction=0.75, impl="foreach")
    host = {pc.param_index for u in opt._host_units for pc in u.pieces}
    assert host == {2, 3}
    for step in range(2):
        for i in (3, 2, 1, 0):
            (ps[i] * 2).sum().backward()
            if i == 3:  # the next gradient (param 2) is the host lane's: no slots yet
                assert not opt._ring.slots, step
            if i == 2 and step == 1:  # the next one (param 1) is the slot lane's: prefetched
                assert opt._ring.slots and opt._ring._held.count(None) < len(opt._ring.slots)
        opt.step()
