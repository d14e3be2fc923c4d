"""Full-vocab and top-k divergences: chunked kernels vs row loops (fp64) and an independent JSD."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import mopd.divergences as div
from mcore_distill.testing import assert_close
from mopd import reference as ref
from mopd.config import DivergenceConfig
from mopd.errors import ConfigError, NonFiniteInputError

D = torch.float64


def _data(N=13, V=11, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (2 * torch.randn(N, V, dtype=D, generator=g)).requires_grad_(True)
    t = torch.log_softmax(2 * torch.randn(N, V, dtype=D, generator=g), -1)
    ids = torch.argsort(torch.rand(N, V, generator=g), -1)[:, :k]
    mask = torch.rand(N, generator=g) > 0.25
    return z, t, ids, t.gather(-1, ids), mask


def _grad(loss, z):
    return torch.autograd.grad(loss, z)[0]


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.3),
                                       ("jsd", 1.0)])
@pytest.mark.parametrize("temperature,chunk_rows", [(1.0, 4), (0.7, 1), (1.3, 100)])
def test_full_vocab_matches_row_loop(kind, beta, temperature, chunk_rows):
    z, t, _, _, mask = _data()
    cfg = DivergenceConfig(kind=kind, beta=beta, temperature=temperature, chunk_rows=chunk_rows)
    loss, n = div.full_vocab_divergence(z, t, mask, config=cfg)
    z2 = z.detach().clone().requires_grad_(True)
    expect = ref.divergence_reference(z2, t, mask, kind=kind, beta=beta, temperature=temperature)
    assert int(n) == int(mask.sum())
    assert_close("loss", expect.detach(), loss.detach(), atol=1e-12, rtol=1e-12)
    assert_close("grad", _grad(expect, z2), _grad(2.0 * loss, z) / 2.0, atol=1e-12, rtol=1e-12)


def _independent_generalized_jsd(student_logits, teacher_logits, beta):
    """TRL-style generalized JSD written from its definition with F.kl_div (not our code path)."""
    s = F.log_softmax(student_logits, -1)
    t = F.log_softmax(teacher_logits, -1)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)  # KL(T‖S)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)  # KL(S‖T)
    b = torch.tensor(beta, dtype=s.dtype)
    m = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), 0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True).sum(-1)  # KL(T‖M)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)  # KL(S‖M)
    return beta * kl_t + (1 - beta) * kl_s


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_jsd_matches_independent_formula(beta):
    g = torch.Generator().manual_seed(7)
    zs = torch.randn(19, 33, dtype=D, generator=g, requires_grad=True)
    zt = 3 * torch.randn(19, 33, dtype=D, generator=g)
    loss, _ = div.full_vocab_divergence(zs, zt, config=DivergenceConfig(kind="jsd", beta=beta, chunk_rows=5))
    zs2 = zs.detach().clone().requires_grad_(True)
    expect = _independent_generalized_jsd(zs2, zt, beta).sum()
    assert_close("jsd", expect.detach(), loss.detach(), atol=1e-12, rtol=1e-12)
    assert_close("grad", _grad(expect, zs2), _grad(loss, zs), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("tail", ["bucket", "renorm"])
@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.4)])
def test_topk_matches_coarsened_closed_form(tail, kind, beta):
    z, _, ids, t_k, mask = _data(seed=3)
    cfg = DivergenceConfig(kind=kind, beta=beta, top_k_tail=tail, chunk_rows=3, temperature=0.9)
    loss, _ = div.topk_divergence(z, ids, t_k, mask, config=cfg)
    z2 = z.detach().clone().requires_grad_(True)
    expect = ref.topk_divergence_reference(z2, ids, t_k, mask, kind=kind, beta=beta, temperature=0.9, tail=tail)
    assert_close("loss", expect.detach(), loss.detach(), atol=1e-12, rtol=1e-12)
    assert_close("grad", _grad(expect, z2), _grad(loss, z), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_topk_with_full_width_equals_full_vocab(kind):
    z, t, _, _, mask = _data(N=6, V=9, seed=4)
    ids = torch.argsort(torch.rand(6, 9, generator=torch.Generator().manual_seed(1)), -1)
    cfg = DivergenceConfig(kind=kind)
    full, _ = div.full_vocab_divergence(z, t, mask, config=cfg)
    topk, _ = div.topk_divergence(z, ids, t.gather(-1, ids), mask, config=cfg)
    assert_close("k=V", full.detach(), topk.detach(), atol=1e-12, rtol=1e-12)


def test_masked_rows_with_garbage_are_inert_and_empty_mask_is_zero():
    z, t, ids, t_k, mask = _data(seed=5)
    mask[2] = False
    cfg = DivergenceConfig(kind="jsd", beta=0.3, chunk_rows=4)
    clean, _ = div.full_vocab_divergence(z, t, mask, config=cfg)
    g_clean = _grad(clean, z)
    t_bad, z_bad = t.clone(), z.detach().clone()
    t_bad[2] = float("nan")
    z_bad[2, 0] = float("inf")
    z_bad.requires_grad_(True)
    out, _ = div.full_vocab_divergence(z_bad, t_bad, mask, config=cfg)
    g = _grad(out, z_bad)
    assert torch.isfinite(g).all()
    assert_close("loss", clean.detach(), out.detach(), atol=0, rtol=0)
    assert_close("grad", g_clean, g, atol=0, rtol=0)
    tk_bad = t_k.clone()
    tk_bad[2] = float("nan")
    out_k, _ = div.topk_divergence(z, ids, tk_bad, mask, config=cfg)
    assert torch.isfinite(out_k)
    empty, n = div.full_vocab_divergence(z, t, torch.zeros_like(mask), config=cfg)
    assert empty.item() == 0.0 and int(n) == 0 and empty.requires_grad
    assert torch.equal(_grad(empty, z), torch.zeros_like(z))


def test_nonfinite_active_raises():
    z, t, ids, t_k, mask = _data(seed=6)
    mask[4] = True
    t[4, 3] = float("nan")
    with pytest.raises(NonFiniteInputError, match=r"teacher_logp is non-finite at active position \(4, 3\)"):
        div.full_vocab_divergence(z, t, mask, config=DivergenceConfig())
    bad = ids.clone()
    bad[4, 0] = 99
    with pytest.raises(ValueError, match="teacher_ids out of range"):
        div.topk_divergence(z, bad, t_k, mask, config=DivergenceConfig())


_DIV_CHANGES = {"kind": "forward_kl", "beta": 0.2, "temperature": 0.5, "top_k_tail": "renorm"}


def test_every_divergence_config_value_reaches_the_kernel(monkeypatch):
    names = {f.name for f in dataclasses.fields(DivergenceConfig)}
    assert names == set(_DIV_CHANGES) | {"chunk_rows", "check_finite"}, "add the new field to _DIV_CHANGES"
    z, _, ids, t_k, mask = _data(seed=8)
    base_cfg = DivergenceConfig(kind="jsd", beta=0.6)

    def value(cfg):
        return div.topk_divergence(z, ids, t_k, mask, config=cfg)[0].item()

    base = value(base_cfg)
    for name, v in _DIV_CHANGES.items():
        assert abs(value(dataclasses.replace(base_cfg, **{name: v})) - base) > 1e-6, f"divergence.{name} ignored"
    # chunk_rows changes the working set, not the value: count the chunks the kernel runs
    calls = []
    real = div.row_divergence
    monkeypatch.setattr(div, "row_divergence", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k))[1])
    for rows in (1, 5, 13):
        calls.clear()
        got = value(dataclasses.replace(base_cfg, chunk_rows=rows))
        assert len(calls) == math.ceil(13 / rows) and max(calls) <= rows
        assert abs(got - base) < 1e-12
    # check_finite: on → typed error on a NaN in an active row, off → the NaN reaches the loss
    t_nan = t_k.clone()
    t_nan[int(mask.nonzero()[0, 0]), 0] = float("nan")
    with pytest.raises(NonFiniteInputError):
        div.topk_divergence(z, ids, t_nan, mask, config=base_cfg)
    off = div.topk_divergence(z, ids, t_nan, mask, config=dataclasses.replace(base_cfg, check_finite=False))[0]
    assert math.isnan(off.item())


def test_teacher_zero_probability_is_allowed():
    z, t, _, _, mask = _data(seed=9)
    t[:, 0] = -math.inf
    t = torch.log_softmax(t, -1)
    loss, _ = div.full_vocab_divergence(z, t, mask, config=DivergenceConfig(kind="forward_kl"))
    assert torch.isfinite(loss) and torch.isfinite(_grad(loss, z)).all()
    z2 = z.detach().clone().requires_grad_(True)
    expect = ref.divergence_reference(z2, t, mask, kind="forward_kl", beta=0.5, temperature=1.0)
    assert_close("loss", expect.detach(), loss.detach(), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kwargs,match", [({"kind": "tv"}, "divergence.kind"), ({"beta": 1.5}, "divergence.beta"),
                                          ({"temperature": 0.0}, "divergence.temperature"),
                                          ({"chunk_rows": 0}, "divergence.chunk_rows"),
                                          ({"top_k_tail": "drop"}, "divergence.top_k_tail")])
def test_divergence_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DivergenceConfig(**kwargs)


@pytest.mark.parametrize("kind,beta", [("reverse_kl", 0.5), ("jsd", 1.0), ("jsd", 0.3), ("forward_kl", 0.5)],
                         ids=["reverse_kl", "jsd-beta1", "jsd-beta0.3", "forward_kl"])
def test_teacher_minus_inf_gives_finite_loss_and_grad_against_fp64_reference(kind, beta):
    """Teacher probability 0 (log-prob −inf, allowed): reverse KL and JSD(β=1) would be +inf with
    NaN gradients; they are computed against the teacher floored at 2^−126 (fp64 reference built in
    probability space), the others stay exact. Loss and gradient finite, equal to 1e-12."""
    z, t, _, _, mask = _data(N=9, V=13, seed=11)
    t = t.clone()
    t[:, 0] = -math.inf  # a token the teacher never emits, in every row
    t[2, 5:9] = -math.inf
    t[3, 1] = -200.0  # finite but below the floor: floored the same way
    t = torch.log_softmax(t, -1)
    cfg = DivergenceConfig(kind=kind, beta=beta, chunk_rows=4)
    loss, _ = div.full_vocab_divergence(z, t, mask, config=cfg)
    g = _grad(loss, z)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    z2 = z.detach().clone().requires_grad_(True)
    expect = ref.divergence_reference(z2, t, mask, kind=kind, beta=beta, temperature=1.0)
    assert_close("loss", expect.detach(), loss.detach(), atol=1e-12, rtol=1e-12)
    assert_close("grad", _grad(expect, z2), g, atol=1e-12, rtol=1e-12)
    if kind == "reverse_kl":  # the floor is exactly "−inf reads as log 2^−126"
        floored = t.clamp(min=-126 * math.log(2.0))
        same, _ = div.full_vocab_divergence(z, floored, mask, config=cfg)
        assert_close("floored", same.detach(), loss.detach(), atol=1e-12, rtol=1e-12)
        assert loss.item() > div.full_vocab_divergence(z, torch.log_softmax(t.clamp(min=-30.0), -1), mask,
                                                      config=cfg)[0].item()  # impossible tokens cost more


@pytest.mark.parametrize("kind,beta", [("reverse_kl", 0.5), ("jsd", 1.0)])
def test_topk_bucket_with_teacher_mass_one_is_finite(kind, beta):
    """Teacher top-k mass rounded to 1 gives a tail of probability 0 (−inf): floored like any other."""
    z, _, ids, _, mask = _data(N=7, V=10, k=3, seed=12)
    t_k = torch.log_softmax(torch.randn(7, 3, dtype=D, generator=torch.Generator().manual_seed(3)), -1)
    cfg = DivergenceConfig(kind=kind, beta=beta, top_k_tail="bucket")
    loss, _ = div.topk_divergence(z, ids, t_k, mask, config=cfg)
    g = _grad(loss, z)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    z2 = z.detach().clone().requires_grad_(True)
    expect = ref.topk_divergence_reference(z2, ids, t_k, mask, kind=kind, beta=beta, temperature=1.0, tail="bucket")
    assert_close("loss", expect.detach(), loss.detach(), atol=1e-12, rtol=1e-12)
    assert_close("grad", _grad(expect, z2), g, atol=1e-12, rtol=1e-12)


def test_teacher_row_without_mass_is_a_typed_error():
    z, t, ids, t_k, mask = _data(seed=13)
    r = int(mask.nonzero()[0, 0])
    t = t.clone()
    t[r] = -math.inf
    with pytest.raises(NonFiniteInputError, match=f"teacher_logp row {r} is active but every entry is -inf"):
        div.full_vocab_divergence(z, t, mask, config=DivergenceConfig(kind="forward_kl"))
    t_k = t_k.clone()
    t_k[r] = -math.inf
    with pytest.raises(NonFiniteInputError, match="no probability mass"):
        div.topk_divergence(z, ids, t_k, mask, config=DivergenceConfig(top_k_tail="renorm"))
    loss, _ = div.topk_divergence(z, ids, t_k, mask, config=DivergenceConfig(kind="forward_kl", top_k_tail="bucket"))
    assert torch.isfinite(loss)  # bucket: the tail holds all the mass
