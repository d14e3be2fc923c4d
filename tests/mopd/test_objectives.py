"""Sampled-token objectives: enumerated oracles (fp64, 1e-12), loop reference, masking, composition."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mcore_distill.testing import assert_close
from mopd import reference as ref
from mopd.config import MOPDLossConfig
from mopd.errors import ConfigError, NonFiniteInputError
from mopd.objectives import TokenTargets, compose_losses, mopd_pg_loss

D = torch.float64


def _enumerated_batch(P: int, V: int, K: int, seed: int):
    """Every vocabulary token of every position as one sample; behaviour policy uniform."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(P, V, dtype=D, generator=g, requires_grad=True)
    teachers = 2.0 * torch.randn(K, P, V, dtype=D, generator=g)
    weights = torch.rand(K, P, dtype=D, generator=g) * 2.0
    if K > 1:
        weights[0, 0] = 0.0  # a zero weight must drop that teacher for that position
    student_logp = torch.log_softmax(theta, -1).reshape(-1)
    old = torch.full((P * V,), -math.log(V), dtype=D)
    t_logp = torch.log_softmax(teachers, -1).reshape(K, -1)
    w_tok = weights[:, :, None].expand(K, P, V).reshape(K, -1)
    return theta, teachers, weights, student_logp, old, t_logp, w_tok


@pytest.mark.parametrize("aggregation,oracle", [
    pytest.param("geometric", ref.enumerated_weighted_reverse_kl, id="geometric"),
    pytest.param("mean", ref.enumerated_mean_reverse_kl, id="mean"),
    pytest.param("arithmetic", ref.enumerated_mixture_reverse_kl, id="arithmetic"),
])
@pytest.mark.parametrize("P,V,K", [(3, 5, 3), (2, 7, 1)])
def test_enumerated_oracle_value_and_gradient(aggregation, oracle, P, V, K):
    theta, teachers, weights, lp, old, t_logp, w_tok = _enumerated_batch(P, V, K, seed=P * 10 + V)
    targets = TokenTargets.from_teachers(t_logp, w_tok)
    cfg = MOPDLossConfig(aggregation=aggregation, is_cap=math.inf)
    out = mopd_pg_loss(lp, old, targets, torch.ones(P * V, dtype=torch.bool), config=cfg)
    value = out.loss * P  # loss is the mean over P·V samples; the oracle sums P positions
    (g_out,) = torch.autograd.grad(value, theta)
    theta_ref = theta.detach().clone().requires_grad_(True)
    expect = oracle(theta_ref, teachers, weights)
    (g_ref,) = torch.autograd.grad(expect, theta_ref)
    assert_close("value", expect.detach(), value.detach(), atol=1e-12, rtol=1e-12)
    assert_close("grad", g_ref, g_out, atol=1e-12, rtol=1e-12)
    # a cap of V (the largest possible ratio V·π) must not change anything either
    out_cap = mopd_pg_loss(lp, old, targets, torch.ones(P * V, dtype=torch.bool),
                           config=MOPDLossConfig(aggregation=aggregation, is_cap=float(V)))
    assert_close("value cap=V", expect.detach(), (out_cap.loss * P).detach(), atol=1e-12, rtol=1e-12)


def test_geometric_and_arithmetic_agree_for_one_teacher_differ_for_two():
    _, _, _, lp, old, t_logp, w_tok = _enumerated_batch(2, 5, 2, seed=3)
    mask = torch.ones_like(lp, dtype=torch.bool)
    one = TokenTargets.from_teachers(t_logp[:1], torch.ones_like(w_tok[:1]))
    two = TokenTargets.from_teachers(t_logp, torch.full_like(w_tok, 0.5))
    losses = {(n, a): mopd_pg_loss(lp, old, t, mask, config=MOPDLossConfig(aggregation=a)).loss.item()
              for n, t in (("one", one), ("two", two)) for a in ("geometric", "arithmetic")}
    assert abs(losses["one", "geometric"] - losses["one", "arithmetic"]) < 1e-12
    assert abs(losses["two", "geometric"] - losses["two", "arithmetic"]) > 1e-3


def _random_tokens(T: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lp = (-3 * torch.rand(T, dtype=D, generator=g)).requires_grad_(True)
    old = lp.detach() + 1.5 * torch.randn(T, dtype=D, generator=g)  # ratios from ~0.01 to ~90
    t_logp = -4 * torch.rand(K, T, dtype=D, generator=g)
    w = torch.rand(K, T, dtype=D, generator=g) * (torch.rand(K, T, generator=g) > 0.3)
    w[0] = w[0] + 0.1  # every token has one positive weight
    mask = torch.rand(T, generator=g) > 0.2
    norm = mask | (torch.rand(T, generator=g) > 0.5)
    rl_adv = torch.randn(T, dtype=D, generator=g)
    return lp, old, t_logp, w, mask, norm, rl_adv


@pytest.mark.parametrize("aggregation", ["geometric", "mean", "arithmetic"])
@pytest.mark.parametrize("is_cap,is_floor,adv_clip,rl_adv_coef", [
    pytest.param(5.0, 0.0, None, 0.0, id="cap5"),
    pytest.param(2.0, 0.5, 0.7, 0.3, id="band-clip-rl"),
    pytest.param(math.inf, 0.0, 1.0, -0.5, id="nocap-clip"),
])
def test_against_token_loop_reference(aggregation, is_cap, is_floor, adv_clip, rl_adv_coef):
    lp, old, t_logp, w, mask, norm, rl_adv = _random_tokens(37, 3, seed=11)
    cfg = MOPDLossConfig(aggregation=aggregation, is_cap=is_cap, is_floor=is_floor, adv_clip=adv_clip,
                         rl_adv_coef=rl_adv_coef)
    out = mopd_pg_loss(lp, old, TokenTargets.from_teachers(t_logp, w), mask, config=cfg,
                       normalization_mask=norm, rl_advantages=rl_adv)
    (g,) = torch.autograd.grad(out.loss, lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    expect = ref.pg_loss_reference(lp2, old, t_logp, w, mask, aggregation=aggregation, is_cap=is_cap,
                                   is_floor=is_floor, adv_clip=adv_clip, rl_advantages=rl_adv,
                                   rl_adv_coef=rl_adv_coef, normalization_mask=norm)
    (g_ref,) = torch.autograd.grad(expect, lp2)
    assert_close("loss", expect.detach(), out.loss.detach(), atol=1e-12, rtol=1e-12)
    assert_close("grad", g_ref, g, atol=1e-12, rtol=1e-12)
    assert int(out.num_tokens) == int(norm.sum())
    assert (out.stats["capped"] & ~mask).sum() == 0
    if math.isfinite(is_cap):
        assert out.stats["capped"].any()  # the case really exercises truncation


def test_masked_extremes_are_finite_and_inert():
    lp, old, t_logp, w, mask, _, _ = _random_tokens(16, 2, seed=5)
    mask[3] = mask[7] = mask[9] = False
    targets = TokenTargets.from_teachers(t_logp, w)
    clean = mopd_pg_loss(lp, old, targets, mask, config=MOPDLossConfig())
    (g_clean,) = torch.autograd.grad(clean.loss, lp)
    lp_bad = lp.detach().clone()
    old_bad, s_bad, w_bad = old.clone(), targets.logp_sum.clone(), targets.weight_sum.clone()
    lp_bad[3], old_bad[3] = 0.0, -1e30          # ratio e^{1e30}
    lp_bad[7], old_bad[7] = float("nan"), 1e30  # NaN student, ratio 0
    s_bad[9], w_bad[9], old_bad[9] = float("inf"), float("nan"), float("-inf")
    lp_bad.requires_grad_(True)
    out = mopd_pg_loss(lp_bad, old_bad, TokenTargets(s_bad, w_bad), mask, config=MOPDLossConfig())
    (g,) = torch.autograd.grad(out.loss, lp_bad)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert_close("loss", clean.loss.detach(), out.loss.detach(), atol=0, rtol=0)
    assert_close("grad", g_clean, g, atol=0, rtol=0)


def test_empty_mask_is_differentiable_zero():
    lp, old, t_logp, w, _, _, _ = _random_tokens(8, 2, seed=2)
    mask = torch.zeros(8, dtype=torch.bool)
    out = mopd_pg_loss(lp, old, TokenTargets.from_teachers(t_logp, w), mask, config=MOPDLossConfig())
    assert out.loss.item() == 0.0 and out.loss.requires_grad and int(out.num_tokens) == 0
    out.loss.backward()
    assert lp.grad is not None and torch.equal(lp.grad, torch.zeros_like(lp))


@pytest.mark.parametrize("which", ["student_logp", "old_logp", "targets.logp_sum", "targets.weight_sum"])
def test_nonfinite_active_input_raises_naming_tensor(which):
    lp, old, t_logp, w, mask, _, _ = _random_tokens(8, 2, seed=4)
    mask[:] = True
    targets = TokenTargets.from_teachers(t_logp, w)
    tensors = {"student_logp": lp.detach().clone(), "old_logp": old.clone(),
               "targets.logp_sum": targets.logp_sum.clone(), "targets.weight_sum": targets.weight_sum.clone()}
    tensors[which][5] = float("nan")
    with pytest.raises(NonFiniteInputError, match=rf"{which} is non-finite at active position \(5,\)"):
        mopd_pg_loss(tensors["student_logp"], tensors["old_logp"],
                     TokenTargets(tensors["targets.logp_sum"], tensors["targets.weight_sum"]), mask,
                     config=MOPDLossConfig())


def test_active_token_without_teacher_raises():
    lp, old, t_logp, w, mask, _, _ = _random_tokens(8, 2, seed=4)
    mask[2] = True
    t = TokenTargets.from_teachers(t_logp, w)
    wsum = t.weight_sum.clone()
    wsum[2] = 0.0
    with pytest.raises(ValueError, match=r"weight_sum <= 0 at active position \(2,\)"):
        mopd_pg_loss(lp, old, TokenTargets(t.logp_sum, wsum), mask, config=MOPDLossConfig())


def test_compose_skips_zero_coefficient_terms():
    x = torch.tensor(2.0, requires_grad=True)
    nan = torch.tensor(float("nan"))
    assert compose_losses(rl_loss=nan, distill_loss=3 * x, rl_coef=0.0, distill_coef=0.5).item() == 3.0
    assert compose_losses(rl_loss=3 * x, distill_loss=nan, rl_coef=2.0, distill_coef=0.0).item() == 12.0
    assert compose_losses(rl_loss=None, distill_loss=x, rl_coef=0.0, distill_coef=1.0).item() == 2.0
    assert compose_losses(rl_loss=x, distill_loss=x, rl_coef=1.0, distill_coef=3.0).item() == 8.0
    with pytest.raises(ValueError, match="rl_loss is None"):
        compose_losses(rl_loss=None, distill_loss=x, rl_coef=1.0, distill_coef=1.0)
    with pytest.raises(ValueError, match="both 0"):
        compose_losses(rl_loss=x, distill_loss=x, rl_coef=0.0, distill_coef=0.0)


def _total(cfg: MOPDLossConfig, nan_at: int | None = None) -> float:
    """The full sampled-token path driven only by ``cfg``: distillation loss, RL composition."""
    lp, old, t_logp, w, mask, norm, rl_adv = _random_tokens(40, 2, seed=9)
    targets = TokenTargets.from_teachers(t_logp, w)
    if nan_at is not None:
        lp = lp.detach().clone()
        lp[nan_at] = float("nan")
        mask = mask.clone()
        mask[nan_at] = True
    out = mopd_pg_loss(lp, old, targets, mask, config=cfg, normalization_mask=norm, rl_advantages=rl_adv)
    rl_loss = torch.tensor(0.25, dtype=D)
    return compose_losses(rl_loss=rl_loss, distill_loss=out.loss, rl_coef=cfg.rl_coef,
                          distill_coef=cfg.distill_coef).item()


# One change per MOPDLossConfig field; the test below fails if a field has no entry.
_LOSS_CHANGES = {
    "aggregation": "mean",
    "is_cap": 1.5,
    "is_floor": 0.8,
    "adv_clip": 0.2,
    "rl_adv_coef": 0.7,
    "rl_coef": 0.5,
    "distill_coef": 0.3,
}


def test_every_loss_config_value_reaches_the_kernel():
    names = {f.name for f in dataclasses.fields(MOPDLossConfig)}
    assert names == set(_LOSS_CHANGES) | {"check_finite"}, "add the new field to _LOSS_CHANGES"
    base = _total(MOPDLossConfig())
    for name, value in _LOSS_CHANGES.items():
        changed = _total(dataclasses.replace(MOPDLossConfig(), **{name: value}))
        assert abs(changed - base) > 1e-6, f"changing loss.{name} to {value!r} did not change the loss"
    # check_finite: on → typed error, off → the NaN flows into the loss
    with pytest.raises(NonFiniteInputError):
        _total(MOPDLossConfig(), nan_at=0)
    assert math.isnan(_total(MOPDLossConfig(check_finite=False), nan_at=0))


@pytest.mark.parametrize("kwargs,match", [
    ({"aggregation": "harmonic"}, "loss.aggregation"),
    ({"is_cap": 0.0}, "loss.is_cap"),
    ({"is_cap": float("nan")}, "loss.is_cap"),
    ({"is_floor": 6.0}, "loss.is_floor"),
    ({"adv_clip": -1.0}, "loss.adv_clip"),
    ({"rl_coef": float("inf")}, "loss.rl_coef"),
    ({"rl_coef": 0.0, "distill_coef": 0.0}, "both 0"),
])
def test_loss_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MOPDLossConfig(**kwargs)
