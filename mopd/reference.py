"""Plain-torch references for ``mopd`` (fp64-capable; loops over tokens and vocabulary).

These define what the fast paths must compute; tests compare them with tolerances written in
the tests. Nothing here is used by the training path.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "TEACHER_PROB_FLOOR",
    "enumerated_weighted_reverse_kl",
    "enumerated_mean_reverse_kl",
    "enumerated_mixture_reverse_kl",
    "pg_loss_reference",
    "divergence_reference",
    "topk_divergence_reference",
    "aggregate_reference",
]


def _enum_kl(p_log: list[float] | torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    total = p_log[0] * 0.0
    for a in range(q_log.shape[-1]):
        total = total + p_log[a].exp() * (p_log[a] - q_log[a])
    return total


def enumerated_weighted_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                   weights: torch.Tensor) -> torch.Tensor:
    """Σ_p Σ_j w_{j,p} KL(π_θ,p ‖ π_Tj,p), by enumerating the vocabulary.

    ``student_logits [P, V]`` (may carry grad), ``teacher_logits [K, P, V]``, ``weights [K, P]``.
    """
    total = student_logits.sum() * 0.0
    for p in range(student_logits.shape[0]):
        s = torch.log_softmax(student_logits[p], -1)
        for j in range(teacher_logits.shape[0]):
            t = torch.log_softmax(teacher_logits[j, p], -1)
            total = total + weights[j, p] * _enum_kl(s, t)
    return total


def enumerated_mean_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                               weights: torch.Tensor) -> torch.Tensor:
    """Σ_p Σ_j ŵ_{j,p} KL(π_θ,p ‖ π_Tj,p) with ŵ = w / Σ_j w (per position)."""
    return enumerated_weighted_reverse_kl(student_logits, teacher_logits, weights / weights.sum(0, keepdim=True))


def enumerated_mixture_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                  weights: torch.Tensor) -> torch.Tensor:
    """Σ_p KL(π_θ,p ‖ Σ_j ŵ_{j,p} π_Tj,p), the mixture probabilities summed token by token."""
    total = student_logits.sum() * 0.0
    for p in range(student_logits.shape[0]):
        s = torch.log_softmax(student_logits[p], -1)
        wsum = float(weights[:, p].sum())
        mix = []
        for a in range(student_logits.shape[-1]):
            prob = 0.0
            for j in range(teacher_logits.shape[0]):
                prob = prob + float(weights[j, p]) / wsum * torch.softmax(teacher_logits[j, p], -1)[a]
            mix.append(torch.log(torch.as_tensor(prob, dtype=student_logits.dtype)))
        total = total + _enum_kl(s, torch.stack(mix))
    return total


def pg_loss_reference(student_logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor,
                      weights: torch.Tensor, mask: torch.Tensor, *, aggregation: str, is_cap: float,
                      is_floor: float = 0.0, adv_clip: float | None = None, rl_advantages: torch.Tensor | None = None,
                      rl_adv_coef: float = 0.0, normalization_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token-by-token loop of the truncated-IS distillation loss from per-teacher log-probs.

    ``student_logp, old_logp, mask [T]``, ``teacher_logp, weights [K, T]`` (flat tokens).
    loss = −(1/max(N,1)) Σ_t m_t ρ_t A_t ℓθ_t-gradient carrier, see :mod:`mopd.objectives`.
    """
    total = student_logp.sum() * 0.0
    for t in range(student_logp.shape[0]):
        if not bool(mask[t]):
            continue
        lp = student_logp[t]
        sg = float(lp.detach())
        ks = [j for j in range(teacher_logp.shape[0]) if float(weights[j, t]) > 0]
        wsum = sum(float(weights[j, t]) for j in ks)
        if aggregation == "geometric":
            a = sum(float(weights[j, t]) * (float(teacher_logp[j, t]) - sg) for j in ks)
        elif aggregation == "mean":
            a = sum(float(weights[j, t]) / wsum * (float(teacher_logp[j, t]) - sg) for j in ks)
        elif aggregation == "arithmetic":
            a = math.log(sum(float(weights[j, t]) / wsum * math.exp(float(teacher_logp[j, t])) for j in ks)) - sg
        else:
            raise ValueError(aggregation)
        if rl_adv_coef:
            a += rl_adv_coef * float(rl_advantages[t])
        if adv_clip is not None:
            a = max(-adv_clip, min(adv_clip, a))
        rho = min(max(math.exp(sg - float(old_logp[t])), is_floor), is_cap)
        total = total - rho * a * torch.exp(lp - lp.detach())
    n = int((mask if normalization_mask is None else normalization_mask).sum())
    return total / max(n, 1)


TEACHER_PROB_FLOOR = 2.0 ** -126
"""Reverse KL compares the student with the teacher probabilities floored at this (fp32's
smallest normal number): KL(S‖T) is +∞ once the teacher gives probability 0 to any token."""


def _div(s: torch.Tensor, t: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """One row; the mixture built from probabilities (not log-space) for independence."""
    ps, pt = s.exp(), t.exp()

    def kl(p, q):
        return sum(p[a] * (torch.log(p[a]) - torch.log(q[a])) for a in range(p.shape[0]) if float(p[a].detach()) > 0)

    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return kl(pt, ps)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return kl(ps, pt.clamp(min=TEACHER_PROB_FLOOR))
    m = (1 - beta) * ps + beta * pt
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


def divergence_reference(student_logits: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, *,
                         kind: str, beta: float, temperature: float) -> torch.Tensor:
    """Σ over active rows of the full-vocabulary divergence, row by row."""
    total = student_logits.sum() * 0.0
    for r in range(student_logits.shape[0]):
        if bool(mask[r]):
            s = torch.log_softmax(student_logits[r] / temperature, -1)
            total = total + _div(s, torch.log_softmax(teacher_logp[r], -1), kind, beta)
    return total


def topk_divergence_reference(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
                              mask: torch.Tensor, *, kind: str, beta: float, temperature: float,
                              tail: str) -> torch.Tensor:
    """Σ over active rows of the top-k divergence: the coarsened distributions are built by
    summing probabilities of ids outside the top-k one by one (``bucket``) or renormalized."""
    total = student_logits.sum() * 0.0
    v = student_logits.shape[-1]
    for r in range(student_logits.shape[0]):
        if not bool(mask[r]):
            continue
        ps = torch.softmax(student_logits[r] / temperature, -1)
        ids = [int(i) for i in teacher_ids[r]]
        s_k = torch.stack([ps[i] for i in ids])
        t_k = teacher_logp[r].exp()
        if tail == "renorm":
            s_k, t_k = s_k / s_k.sum(), t_k / t_k.sum()
        elif len(ids) < v:
            rest = sum(ps[i] for i in range(v) if i not in ids)
            s_k = torch.cat([s_k, rest.reshape(1)])
            t_k = torch.cat([t_k, (1 - t_k.sum()).clamp(min=0).reshape(1)])
        total = total + _div(torch.log(s_k), torch.log(t_k), kind, beta)
    return total


def aggregate_reference(teacher_logp: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Dense (S, W, L) from ``teacher_logp [K, B, S]`` and per-sample ``weights [K, B]``, by a loop over K."""
    s = torch.zeros_like(teacher_logp[0])
    w = torch.zeros_like(teacher_logp[0])
    prob = torch.zeros_like(teacher_logp[0])
    for j in range(teacher_logp.shape[0]):
        wj = weights[j][:, None].expand_as(s)
        on = wj > 0
        s = s + torch.where(on, wj * teacher_logp[j], torch.zeros_like(s))
        w = w + wj
        prob = prob + torch.where(on, wj * teacher_logp[j].exp(), torch.zeros_like(s))
    return s, w, torch.log(prob)
