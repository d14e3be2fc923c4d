"""StagedAdamW vs torch.optim.AdamW and the fp64 reference, on CPU slots (same code path as GPU)."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import assert_close
from optim_staged import HostMemoryError, SlotConfig, StagedAdamW, StagedConfigError
from optim_staged.reference import reference_adamw_step

SHAPES = [(7, 13), (1031,), (3, 5, 11), (64, 33), (1,)]


def _run(staged_kwargs, torch_kwargs, *, steps=10, dtype=torch.float32, seed=0, schedule=True):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in init]
    out = [p.clone().requires_grad_() for p in init]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, **torch_kwargs)
    o_out = StagedAdamW(out, lr=1e-2, weight_decay=0.1, **staged_kwargs)
    for s in range(steps):
        for a, b in zip(ref, out):
            gr = torch.randn(a.shape, generator=g, dtype=dtype)
            a.grad, b.grad = gr.clone(), gr.clone()
        if schedule and s in (4, 7):  # LR / WD schedule changes between steps take effect
            for o in (o_ref, o_out):
                for grp in o.param_groups:
                    grp["lr"] *= 0.5
                    grp["weight_decay"] = 0.05 * s
        o_ref.step()
        o_out.step()
    o_out.drain(release=False)  # host state views are current after drain (slot cache written back)
    return ref, out, o_ref, o_out


@pytest.mark.parametrize("slot_numel", [1024, 1500, 4096, 1 << 20], ids=lambda n: f"slot{n}")
@pytest.mark.parametrize("num_slots", [1, 3])
@pytest.mark.parametrize("keep_resident", [True, False], ids=["cache", "nocache"])
def test_staged_adamw_matches_torch_foreach(slot_numel, num_slots, keep_resident):
    slots = SlotConfig(slot_numel=slot_numel, num_slots=num_slots, keep_resident=keep_resident)
    ref, out, o_ref, o_out = _run(dict(slots=slots, impl="foreach"), dict(foreach=True))
    for i, (a, b) in enumerate(zip(ref, out)):
        assert_close(f"param{i}", a, b, atol=0, rtol=1e-6)
        assert_close(f"master{i}", a, o_out.state[b]["master_param"], atol=0, rtol=1e-6)
        assert_close(f"exp_avg{i}", o_ref.state[a]["exp_avg"], o_out.state[b]["exp_avg"], atol=0, rtol=1e-6)
        assert_close(f"exp_avg_sq{i}", o_ref.state[a]["exp_avg_sq"], o_out.state[b]["exp_avg_sq"], atol=0, rtol=1e-6)
    assert o_out.param_groups[0]["step"] == 10
    assert o_out.state[out[0]]["exp_avg"].device.type == "cpu"


@pytest.mark.parametrize("slot_numel", [1024, 4096, 1 << 20], ids=lambda n: f"slot{n}")
def test_staged_adamw_fused_kernel_matches_torch_fused(slot_numel):
    # CPU fused kernel: vector/scalar tails fall differently on chunk views, so allow 1e-6 rel
    # (on the GPU lane the same comparison is bitwise: test_optim_staged_gpu.py).
    ref, out, o_ref, o_out = _run(dict(slots=SlotConfig(slot_numel=slot_numel), impl="fused"), dict(fused=True))
    for i, (a, b) in enumerate(zip(ref, out)):
        assert_close(f"param{i}", a, b, atol=0, rtol=1e-6)
        assert_close(f"exp_avg_sq{i}", o_ref.state[a]["exp_avg_sq"], o_out.state[b]["exp_avg_sq"], atol=1e-12, rtol=1e-6)


def test_staged_adamw_vs_fp64_reference():
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    out = [p.clone().requires_grad_() for p in init]
    ref = [p.clone() for p in init]
    ref_state = [{} for _ in ref]
    opt = StagedAdamW(out, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.2,
                      slots=SlotConfig(slot_numel=1024, num_slots=2))
    for t in range(1, 8):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ref]
        for p, gr in zip(out, grads):
            p.grad = gr.clone()
        opt.step()
        reference_adamw_step(ref, grads, ref_state, step=t, lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6,
                             weight_decay=0.2)
    opt.drain(release=False)
    for i, (a, b) in enumerate(zip(ref, out)):
        # state is fp32, the reference fp64: fp32 rounding over 7 steps
        assert_close(f"param{i}", a, b, atol=1e-6, rtol=1e-5)
        assert_close(f"exp_avg{i}", ref_state[i]["exp_avg"], opt.state[b]["exp_avg"], atol=1e-7, rtol=1e-5)


def test_bf16_param_is_bf16_of_master():
    g = torch.Generator().manual_seed(1)
    ps = [torch.randn(s, generator=g).to(torch.bfloat16).requires_grad_() for s in SHAPES]
    opt = StagedAdamW(ps, lr=1e-2, slots=SlotConfig(slot_numel=1024))
    opt.initialize_state()
    master0 = [opt.state[p]["master_param"].clone() for p in ps]
    for p, m in zip(ps, master0):
        assert torch.equal(m, p.detach().float())
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
    opt.drain(release=False)
    for i, p in enumerate(ps):
        assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16)), f"param{i}"
        assert opt.state[p]["master_param"].dtype == torch.float32


def test_none_grad_skipped_and_staged_fraction():
    g = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in init]
    out = [p.clone().requires_grad_() for p in init]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, foreach=True)
    o_out = StagedAdamW(out, lr=1e-2, staged_fraction=0.5, impl="foreach", slots=SlotConfig(slot_numel=1024))
    res = o_out.residency
    assert res["staged_numel"] > 0 and res["resident_numel"] > 0
    assert res["staged_numel"] + res["resident_numel"] == sum(p.numel() for p in init)
    for _ in range(4):
        for a, b in zip(ref, out):
            gr = torch.randn(a.shape, generator=g)
            a.grad, b.grad = gr.clone(), gr.clone()
        o_ref.step()
        o_out.step()
    # A parameter with no grad is skipped by both (params, moments untouched); the rest step on.
    ref[1].grad = out[1].grad = None
    o_out.drain(release=False)
    before = [out[1].detach().clone(), o_out.state[out[1]]["exp_avg"].clone()]
    for i, (a, b) in enumerate(zip(ref, out)):
        if i != 1:
            gr = torch.randn(a.shape, generator=g)
            a.grad, b.grad = gr.clone(), gr.clone()
    o_ref.step()
    o_out.step()
    o_out.drain(release=False)
    assert torch.equal(out[1].detach(), before[0]) and torch.equal(o_out.state[out[1]]["exp_avg"], before[1])
    for i, (a, b) in enumerate(zip(ref, out)):
        assert_close(f"param{i}", a, b, atol=0, rtol=1e-6)
        assert_close(f"exp_avg{i}", o_ref.state[a]["exp_avg"], o_out.state[b]["exp_avg"], atol=0, rtol=1e-6)


def test_state_dict_roundtrip_and_continue():
    ref, out, o_ref, o_out = _run(dict(slots=SlotConfig(slot_numel=1024), impl="foreach"), dict(foreach=True),
                                  steps=3, schedule=False)
    sd = o_out.state_dict()
    sd = {"state": {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                    for k, v in sd["state"].items()}, "param_groups": [dict(x) for x in sd["param_groups"]]}
    fresh_params = [p.detach().clone().requires_grad_() for p in out]
    fresh = StagedAdamW(fresh_params, lr=1.0, weight_decay=0.0, slots=SlotConfig(slot_numel=2048), impl="foreach")
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == o_out.param_groups[0]["lr"]
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        for a, b, c in zip(ref, out, fresh_params):
            gr = torch.randn(a.shape, generator=g)
            a.grad, b.grad, c.grad = gr.clone(), gr.clone(), gr.clone()
        o_ref.step()
        o_out.step()
        fresh.step()
    for i, (a, c) in enumerate(zip(ref, fresh_params)):
        assert_close(f"param{i}", a, c, atol=0, rtol=1e-6)


def test_load_rejects_missing_moment_and_keeps_state():
    p = torch.randn(10, 10, requires_grad=True)
    opt = StagedAdamW([p], slots=SlotConfig(slot_numel=1024))
    p.grad = torch.ones_like(p)
    opt.step()
    opt.drain(release=False)
    before = opt.state[p]["exp_avg"].clone()
    sd = opt.state_dict()
    bad = {"state": {0: {"master_param": sd["state"][0]["master_param"].clone(), "exp_avg": before.clone(),
                         "step": sd["state"][0]["step"]}}, "param_groups": sd["param_groups"]}
    from optim_staged import CheckpointLayoutError

    with pytest.raises(CheckpointLayoutError, match="exp_avg_sq"):
        opt.load_state_dict(bad)
    assert torch.equal(opt.state[p]["exp_avg"], before)


def test_bad_config_and_host_memory():
    with pytest.raises(StagedConfigError, match="slot_numel=10"):
        SlotConfig(slot_numel=10)
    with pytest.raises(StagedConfigError, match="betas"):
        StagedAdamW([torch.zeros(3, requires_grad=True)], betas=(1.5, 0.9))
    with pytest.raises(StagedConfigError, match="staged_fraction"):
        StagedAdamW([torch.zeros(3, requires_grad=True)], staged_fraction=2.0)
    from optim_staged.slabs import StateSlabs, available_host_bytes

    need = available_host_bytes() * 4
    with pytest.raises(HostMemoryError, match="bytes of host RAM"):
        StateSlabs(("a",), need // 4 * 2)
    with pytest.raises(ValueError, match="closure"):
        StagedAdamW([torch.zeros(3, requires_grad=True)]).step(lambda: 0.0)


def test_add_param_group_keeps_existing_state():
    a = torch.randn(40, requires_grad=True)
    b = torch.randn(7, 3, requires_grad=True)
    ref_a = a.detach().clone().requires_grad_()
    ref_b = b.detach().clone().requires_grad_()
    opt = StagedAdamW([a], lr=1e-2, impl="foreach", slots=SlotConfig(slot_numel=1024))
    ref = torch.optim.AdamW([ref_a], lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        if step == 2:  # a new group mid-training: the first parameter's moments must survive
            opt.add_param_group({"params": [b]})
            ref.add_param_group({"params": [ref_b]})
        for x, y in ((a, ref_a), (b, ref_b)):
            gr = torch.randn(x.shape, generator=g)
            x.grad, y.grad = gr.clone(), gr.clone()
        opt.step()
        ref.step()
    opt.drain(release=False)
    assert_close("a", ref_a, a, atol=0, rtol=1e-6)
    assert_close("exp_avg_a", ref.state[ref_a]["exp_avg"], opt.state[a]["exp_avg"], atol=0, rtol=1e-6)
    # b joined at step 3: torch counts its steps from 1, the staged group counter too (new group)
    assert_close("b", ref_b, b, atol=0, rtol=1e-6)


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_slot_cache_with_host_writes_prefetch_and_reconfigure(num_slots):
    """The slot cache (last units kept on the device, alternating walk order) stays exact when the
    host state is written between steps (set_scaled_state, load_state_dict), when prefetch() runs
    before a step, and when the slot layout changes (set_slot_config)."""
    g = torch.Generator().manual_seed(6)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in init]
    out = [p.clone().requires_grad_() for p in init]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=True)
    o_out = StagedAdamW(out, lr=1e-2, weight_decay=0.1, impl="foreach",
                        slots=SlotConfig(slot_numel=1024, num_slots=num_slots))
    for step in range(9):
        for a, b in zip(ref, out):
            gr = torch.randn(a.shape, generator=g)
            a.grad, b.grad = gr.clone(), gr.clone()
        if step == 2:  # host write of one parameter's moment while its unit may be cached
            for a, b in zip(ref, out):
                x = torch.randn(a.shape, generator=g).abs()
                o_ref.state[a]["exp_avg_sq"].copy_(x)
                o_out.set_scaled_state(b, "exp_avg_sq", x)
        if step == 4:  # round trip through a detached copy of the state dict
            sd = o_out.state_dict()
            sd = {"state": {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                            for k, v in sd["state"].items()}, "param_groups": [dict(x) for x in sd["param_groups"]]}
            o_out.load_state_dict(sd)
        if step == 6:
            o_out.set_slot_config(SlotConfig(slot_numel=1500, num_slots=max(1, num_slots - 1)))
        if step in (3, 5, 7):
            o_out.prefetch()
        o_ref.step()
        o_out.step()
    o_out.drain(release=False)
    for i, (a, b) in enumerate(zip(ref, out)):
        assert_close(f"param{i}", a, b, atol=0, rtol=1e-6)
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close(f"{k}{i}", o_ref.state[a][k], o_out.state[b][k], atol=0, rtol=1e-6)


def test_foreach_update_reads_no_step_from_the_device():
    """With ``step_value`` the foreach path never reads the step tensor back (on CUDA that read
    would be a host sync per unit): a meta-device step tensor, which cannot be read, still works
    and gives the same result as a readable one."""
    from optim_staged.update import adamw_update_

    g = torch.Generator().manual_seed(12)
    p, gr, m, v = (torch.randn(257, generator=g) for _ in range(4))
    v = v.abs()
    outs = []
    for step, value in ((torch.tensor(3.0), None), (torch.empty((), device="meta"), 3)):
        pp, mm, vv = p.clone(), m.clone(), v.clone()
        adamw_update_([pp], [gr], [mm], [vv], step=step, step_value=value, lr=1e-2, beta1=0.9, beta2=0.99,
                      eps=1e-8, weight_decay=0.1, impl="foreach")
        outs.append((pp, mm, vv))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.empty((), device="meta").item()
