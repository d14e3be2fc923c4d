"""Per-unit choice between the fused and foreach AdamW kernels by slice count (issue #24 item 5).

One step mixes both kernels: a unit holding one large parameter (1 slice) runs fused, a unit of
40 small parameters runs foreach. Each parameter is compared with torch's AdamW using the same
kernel, bitwise (units hold whole parameters, so each kernel sees exactly what torch gives it).
"""

from __future__ import annotations

import pytest
import torch

import optim_staged.adamw as adamw_module
from optim_staged import SlotConfig, StagedAdamW, StagedConfigError
from optim_staged.config import AdamWConfig
from optim_staged.update import FUSED_MAX_SLICES, choose_adamw_impl

BIG, SMALL, N_SMALL = 5000, 50, 40


def _params(g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(BIG, generator=g)] + [torch.randn(5, 10, generator=g) for _ in range(N_SMALL)]


@pytest.mark.parametrize("keep_resident", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mixed_units_bitwise_vs_torch_fused_and_foreach(monkeypatch, keep_resident, device):
    """CPU here; the GPU lane runs the same with CUDA streams and pinned slabs."""
    g = torch.Generator().manual_seed(0)
    init = [t.to(device) for t in _params(g)]
    out = [t.clone().requires_grad_() for t in init]
    ref_fused = [init[0].clone().requires_grad_()]
    ref_foreach = [t.clone().requires_grad_() for t in init[1:]]
    kw = dict(lr=1e-2, weight_decay=0.1)
    o_fused, o_foreach = torch.optim.AdamW(ref_fused, fused=True, **kw), torch.optim.AdamW(ref_foreach, foreach=True, **kw)
    # slot = the big parameter: unit 0 = [big] (1 slice), unit 1 = the 40 small ones (40 slices)
    opt = StagedAdamW(out, impl="auto", fused_max_slices=3,
                      slots=SlotConfig(slot_numel=BIG, num_slots=2, keep_resident=keep_resident), **kw)
    calls = []
    real = adamw_module.adamw_update_

    def spy(params, *a, impl, **k):
        calls.append((len(params), impl))
        return real(params, *a, impl=impl, **k)

    monkeypatch.setattr(adamw_module, "adamw_update_", spy)
    for _ in range(6):
        grads = [torch.randn(t.shape, generator=g).to(device) for t in init]
        for ps, gs in ((out, grads), (ref_fused, grads[:1]), (ref_foreach, grads[1:])):
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
        opt.step()
        o_fused.step()
        o_foreach.step()
    opt.drain(release=False)
    assert sorted(set(calls)) == [(1, "fused"), (N_SMALL, "foreach")]
    for a, b, o in [(ref_fused[0], out[0], o_fused)] + [(a, b, o_foreach) for a, b in zip(ref_foreach, out[1:])]:
        assert torch.equal(a, b)
        assert torch.equal(a.cpu(), opt.state[b]["master_param"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(o.state[a][k].cpu(), opt.state[b][k]), k


def test_default_threshold_is_the_measured_one():
    x = torch.zeros(4)
    # CPU: fused at every slice count (measured: faster from 1 to 4096 slices)
    assert FUSED_MAX_SLICES["cpu"] is None and choose_adamw_impl(10**6, x) == "fused"
    assert choose_adamw_impl(5, x, fused_max_slices=4) == "foreach" and choose_adamw_impl(4, x, 4) == "fused"
    assert choose_adamw_impl(1, torch.zeros(4, dtype=torch.int32)) == "foreach"  # no fused kernel for it


def test_fused_max_slices_is_validated():
    with pytest.raises(StagedConfigError, match="fused_max_slices=0"):
        AdamWConfig(fused_max_slices=0)
    with pytest.raises(StagedConfigError, match="fused_max_slices"):
        StagedAdamW([torch.zeros(3, requires_grad=True)], fused_max_slices=2.5)
