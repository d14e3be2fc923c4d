"""Sampled-token distillation objectives over per-token tensors.

Notation, per sampled token t (any shape ``[*]``, typically ``[B, S]`` or packed ``[T]``):
ℓθ = log π_θ(a_t) (student, carries grad), ℓ_old = behaviour log-prob recorded at rollout,
ℓ_j = log π_Tj(a_t) (teacher j), route weights w_j ≥ 0, sg = stop-gradient, m = loss mask.

Teachers reach the loss only as aggregated targets (:class:`TokenTargets`): S = Σ_j w_j ℓ_j,
W = Σ_j w_j and L = log Σ_j w_j π_Tj(a_t). Their cost is O(tokens), flat in the number of
teachers (see :class:`mopd.routing.TargetAccumulator`).

Advantage (``aggregation``):

* geometric:  A = S − W·sg ℓθ          (weighted sampled reverse KL; unnormalized weights)
* mean:       A = S/W − sg ℓθ          (per-teacher advantages averaged with ŵ = w/W)
* arithmetic: A = (L − log W) − sg ℓθ  (log of the arithmetic mixture Σ_j ŵ_j π_Tj)

optionally ``A += rl_adv_coef · A_rl`` and ``A = clip(A, −c, c)``. Policy gradient with a
truncated, detached importance weight and no PPO clip:

    ρ = sg[clip(exp(ℓθ − ℓ_old), is_floor, is_cap)]
    L_sum = −Σ_t m_t ρ_t A_t exp(ℓθ_t − sg ℓθ_t),     loss = L_sum / max(N, 1)

``exp(ℓθ − sg ℓθ)`` is 1 in value and carries ∇ℓθ, so ∇L_sum = −Σ m ρ A ∇ℓθ (REINFORCE).
N counts ``normalization_mask`` (default: the loss mask), e.g. the mask before behavioural
rejection, so surviving tokens are not up-weighted.

With π_old uniform over V tokens, every token enumerated once (N = V per position) and no
truncation, the loss equals Σ_a π_θ(a)(W ℓθ(a) − S(a)) = Σ_j w_j KL(π_θ ‖ π_Tj) in value and
gradient (tested against :func:`mopd.reference.enumerated_weighted_reverse_kl`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mcore_distill.validate import check_type
from mopd.config import MOPDLossConfig
from mopd.errors import NonFiniteInputError

__all__ = [
    "PGOutput",
    "TokenTargets",
    "check_finite",
    "compose_losses",
    "distill_advantage",
    "importance_weight",
    "mopd_pg_loss",
]


@dataclass(frozen=True, slots=True)
class TokenTargets:
    """Aggregated teacher targets per token, all detached, shape ``[*]`` like the tokens.

    ``logp_sum`` S = Σ_j w_j ℓ_j, ``weight_sum`` W = Σ_j w_j, ``mix_lse`` L = log Σ_j w_j e^{ℓ_j}
    (None when the arithmetic mixture is not needed).
    """

    logp_sum: torch.Tensor
    weight_sum: torch.Tensor
    mix_lse: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_type("TokenTargets.logp_sum", self.logp_sum, torch.Tensor)
        check_type("TokenTargets.weight_sum", self.weight_sum, torch.Tensor)
        check_type("TokenTargets.mix_lse", self.mix_lse, torch.Tensor | None)
        if self.weight_sum.shape != self.logp_sum.shape or (
                self.mix_lse is not None and self.mix_lse.shape != self.logp_sum.shape):
            raise ValueError(f"TokenTargets tensors must share one shape, got logp_sum {tuple(self.logp_sum.shape)}, "
                             f"weight_sum {tuple(self.weight_sum.shape)}, mix_lse "
                             f"{None if self.mix_lse is None else tuple(self.mix_lse.shape)}")

    def __getitem__(self, index) -> TokenTargets:
        """The targets at ``index`` of every tensor: a micro-batch's rows (``targets[rows]``), a
        column range (``targets[:, :-1]`` for logits that stop one position early), a mask."""
        return TokenTargets(logp_sum=self.logp_sum[index], weight_sum=self.weight_sum[index],
                            mix_lse=None if self.mix_lse is None else self.mix_lse[index])

    @classmethod
    def from_teachers(cls, teacher_logp: torch.Tensor, weights: torch.Tensor) -> TokenTargets:
        """Dense construction from ``teacher_logp [K, *]`` and ``weights [K, *]`` (broadcastable).

        O(K) memory; the routed path uses :class:`mopd.routing.TargetAccumulator` instead.
        """
        w = torch.broadcast_to(weights, teacher_logp.shape).to(teacher_logp.dtype)
        pos = w > 0
        safe = torch.where(pos, teacher_logp, torch.zeros_like(teacher_logp))
        s = (w * safe).sum(0)
        lse = torch.logsumexp(torch.where(pos, safe + torch.log(torch.where(pos, w, torch.ones_like(w))),
                                          torch.full_like(w, -math.inf)), dim=0)
        return cls(logp_sum=s.detach(), weight_sum=w.sum(0).detach(), mix_lse=lse.detach())


@dataclass(frozen=True, slots=True)
class PGOutput:
    """Result of :func:`mopd_pg_loss`.

    ``loss_sum`` is the numerator (differentiable), ``num_tokens`` the denominator N, ``loss``
    = ``loss_sum / max(N, 1)``. ``stats`` holds detached per-token tensors (``reward``, ``rho``,
    ``capped``, ``adv_clipped``, ``advantage``) for metrics; zero at inactive tokens.
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    loss: torch.Tensor
    stats: dict[str, torch.Tensor]


def check_finite(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise :class:`NonFiniteInputError` naming ``name`` and the first bad index if ``x`` has
    NaN/inf where ``mask`` is True. One host sync."""
    bad = mask & ~torch.isfinite(x)
    if bool(bad.any()):
        idx = tuple(bad.nonzero()[0].tolist())
        raise NonFiniteInputError(
            f"{name} is non-finite at active position {idx} (value {x[idx].item()!r}); "
            f"{int(bad.sum())} such positions"
        )


def importance_weight(student_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, *,
                      is_cap: float, is_floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached truncated ratio ρ = clip(exp(ℓθ − ℓ_old), is_floor, is_cap), ``[*]``.

    Inactive positions are set to Δ = 0 before ``exp`` (so extreme masked values cannot give
    inf/NaN) and report ρ = 0. Returns ``(rho, truncated)`` with ``truncated`` a bool mask of
    active tokens whose raw ratio fell outside the band.
    """
    delta = torch.where(mask, student_logp.detach() - old_logp, torch.zeros_like(old_logp))
    raw = torch.exp(delta)
    rho = raw.clamp(min=is_floor, max=is_cap) if math.isfinite(is_cap) else raw.clamp(min=is_floor)
    truncated = mask & ((raw > is_cap) | (raw < is_floor))
    return torch.where(mask, rho, torch.zeros_like(rho)), truncated


def distill_advantage(student_logp: torch.Tensor, targets: TokenTargets, mask: torch.Tensor, *,
                      aggregation: str, adv_clip: float | None = None, rl_advantages: torch.Tensor | None = None,
                      rl_adv_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Detached advantage ``[*]`` (see module docstring); returns ``(advantage, reward, clipped)``.

    ``reward`` is the unclipped distillation part without the RL term (geometric: S − Wℓθ,
    an estimate of −Σ_j w_j KL(π_θ‖π_Tj)); ``clipped`` marks active tokens hit by ``adv_clip``.
    Inactive positions are zero.
    """
    zero = torch.zeros_like(targets.weight_sum)
    sg = torch.where(mask, student_logp.detach(), zero)
    w = torch.where(mask, targets.weight_sum, torch.ones_like(zero))
    s = torch.where(mask, targets.logp_sum, zero)
    if aggregation == "geometric":
        reward = s - w * sg
    elif aggregation == "mean":
        reward = s / w - sg
    elif aggregation == "arithmetic":
        if targets.mix_lse is None:
            raise ValueError("aggregation='arithmetic' needs TokenTargets.mix_lse (got None)")
        reward = torch.where(mask, targets.mix_lse, zero) - torch.log(w) - sg
    else:
        raise ValueError(f"aggregation must be one of geometric/mean/arithmetic, got {aggregation!r}")
    reward = torch.where(mask, reward, zero)
    adv = reward
    if rl_adv_coef != 0.0:
        if rl_advantages is None:
            raise ValueError(f"rl_adv_coef={rl_adv_coef!r} needs rl_advantages (got None)")
        adv = adv + rl_adv_coef * torch.where(mask, rl_advantages.to(adv.dtype), zero)
    clipped = torch.zeros_like(mask)
    if adv_clip is not None:
        clipped = mask & (adv.abs() > adv_clip)
        adv = adv.clamp(-adv_clip, adv_clip)
    return adv, reward, clipped


def mopd_pg_loss(student_logp: torch.Tensor, old_logp: torch.Tensor, targets: TokenTargets,
                 loss_mask: torch.Tensor, *, config: MOPDLossConfig, normalization_mask: torch.Tensor | None = None,
                 rl_advantages: torch.Tensor | None = None) -> PGOutput:
    """Truncated-IS policy-gradient distillation loss; every tensor ``[*]`` of one shape.

    Args:
        student_logp: ℓθ, with grad.
        old_logp: ℓ_old, behaviour log-probs (detached).
        targets: aggregated teacher targets (detached).
        loss_mask: bool, tokens in the numerator (after any behavioural rejection).
        config: ``aggregation``, ``is_cap``, ``is_floor``, ``adv_clip``, ``rl_adv_coef``,
            ``check_finite`` are read here (the coefficients by :func:`compose_losses`).
        normalization_mask: bool, tokens counted in N (default ``loss_mask``).
        rl_advantages: A_rl per token, required iff ``config.rl_adv_coef != 0``.

    Raises :class:`NonFiniteInputError` on NaN/inf at an active token of any input, and
    ``ValueError`` if an active token has W ≤ 0 (no teacher scored it).
    """
    check_type("config", config, MOPDLossConfig)
    check_type("targets", targets, TokenTargets)
    mask = loss_mask.bool()
    if student_logp.shape != mask.shape or old_logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: student_logp {tuple(student_logp.shape)}, old_logp "
                         f"{tuple(old_logp.shape)}, loss_mask {tuple(mask.shape)}")
    for name, t in (("targets.logp_sum", targets.logp_sum), ("targets.weight_sum", targets.weight_sum)):
        if t.shape != mask.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != loss_mask shape {tuple(mask.shape)}")
    if config.check_finite:
        check_finite("student_logp", student_logp.detach(), mask)
        check_finite("old_logp", old_logp, mask)
        check_finite("targets.logp_sum", targets.logp_sum, mask)
        check_finite("targets.weight_sum", targets.weight_sum, mask)
        if config.aggregation == "arithmetic" and targets.mix_lse is not None:
            check_finite("targets.mix_lse", targets.mix_lse, mask)
        if rl_advantages is not None and config.rl_adv_coef != 0.0:
            check_finite("rl_advantages", rl_advantages, mask)
        no_teacher = mask & (targets.weight_sum <= 0)
        if bool(no_teacher.any()):
            idx = tuple(no_teacher.nonzero()[0].tolist())
            raise ValueError(f"targets.weight_sum <= 0 at active position {idx}: no teacher scored this token")
    adv, reward, clipped = distill_advantage(
        student_logp, targets, mask, aggregation=config.aggregation, adv_clip=config.adv_clip,
        rl_advantages=rl_advantages, rl_adv_coef=config.rl_adv_coef)
    rho, capped = importance_weight(student_logp, old_logp, mask, is_cap=config.is_cap, is_floor=config.is_floor)
    lp = torch.where(mask, student_logp, torch.zeros_like(student_logp))
    carrier = torch.exp(lp - lp.detach())  # == 1, carries ∇ℓθ
    loss_sum = -(rho * adv * carrier).sum()
    norm = mask if normalization_mask is None else normalization_mask.bool()
    n = norm.sum()
    loss = loss_sum / n.clamp(min=1).to(loss_sum.dtype)
    stats = {"reward": reward, "rho": rho, "capped": capped, "adv_clipped": clipped, "advantage": adv}
    return PGOutput(loss_sum=loss_sum, num_tokens=n, loss=loss, stats=stats)


def compose_losses(*, rl_loss: torch.Tensor | None, distill_loss: torch.Tensor | None, rl_coef: float,
                   distill_coef: float) -> torch.Tensor:
    """``rl_coef · rl_loss + distill_coef · distill_loss``; a zero coefficient skips its term
    entirely (its loss is never read, so a NaN there cannot leak). Raises ``ValueError`` if a
    term with a non-zero coefficient is None, or both coefficients are zero."""
    terms = []
    if rl_coef != 0.0:
        if rl_loss is None:
            raise ValueError(f"rl_coef={rl_coef!r} but rl_loss is None")
        terms.append(rl_coef * rl_loss)
    if distill_coef != 0.0:
        if distill_loss is None:
            raise ValueError(f"distill_coef={distill_coef!r} but distill_loss is None")
        terms.append(distill_coef * distill_loss)
    if not terms:
        raise ValueError("rl_coef and distill_coef are both 0")
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]
