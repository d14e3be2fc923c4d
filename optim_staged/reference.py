"""Plain-torch references (fp64-capable, per-tensor loops) for the staged optimizer updates.

These read like the math in ``docs/optim_staged.md`` and are what the fast paths are tested
against; they keep their own state dicts and never stream anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["reference_adamw_step", "reference_muon_step", "identity_orthogonalize"]


@torch.no_grad()
def reference_adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: list[dict[str, torch.Tensor]],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW step ``t = step`` (>= 1) on each ``params[i]`` with ``state[i] = {exp_avg, exp_avg_sq}``.

    p <- p (1 - lr wd); m <- b1 m + (1-b1) g; v <- b2 v + (1-b2) g^2;
    p <- p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). Works in the params' dtype.
    """
    for p, g, s in zip(params, grads, state):
        if "exp_avg" not in s:
            s["exp_avg"] = torch.zeros_like(p)
            s["exp_avg_sq"] = torch.zeros_like(p)
        m, v = s["exp_avg"], s["exp_avg_sq"]
        g = g.to(p.dtype)
        p.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).add_(g * g, alpha=1 - beta2)
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        p.sub_((lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps))


def identity_orthogonalize(update: torch.Tensor) -> torch.Tensor:
    """The identity 'orthogonalizer' (Muon becomes SGD with momentum): exactness tests use it."""
    return update


@torch.no_grad()
def reference_muon_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: list[dict[str, torch.Tensor]],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor] = identity_orthogonalize,
) -> None:
    """Muon step on whole matrices: p <- p - lr wd p; buf <- b buf + (1-b) g;
    u = (1-b) g + b buf if nesterov else buf; p <- p - lr * orthogonalize(u)."""
    for p, g, s in zip(params, grads, state):
        if "momentum_buffer" not in s:
            s["momentum_buffer"] = torch.zeros_like(p)
        buf = s["momentum_buffer"]
        g = g.to(p.dtype)
        p.sub_(p * (lr * weight_decay))
        buf.mul_(momentum).add_(g, alpha=1 - momentum)
        u = g * (1 - momentum) + buf * momentum if nesterov else buf
        p.sub_(lr * orthogonalize(u))
