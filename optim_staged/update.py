"""Pure tensor updates used by the staged optimizers (no state, no streams).

AdamW (decoupled weight decay, no AMSGrad), for step t >= 1 (already incremented)::

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g          (as lerp(m, g, 1 - beta1))
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

``adamw_update_`` runs PyTorch's own kernels on lists of equally-typed tensors: the fused kernel
(``torch._fused_adamw_``) or the same foreach op sequence as ``torch.optim.AdamW(foreach=True)``.
The step counter is passed in and never incremented here, so calling it once per slot chunk with
the group's step does not double-count.

Muon (emerging-optimizers semantics), on one whole matrix::

    p   <- p - lr * wd * p
    buf <- lerp(buf, g, 1 - beta)
    u   <- lerp(g, buf, beta) if nesterov else buf
    p   <- p - lr * orthogonalize(u)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FUSED_MAX_SLICES", "adamw_update_", "choose_adamw_impl", "fused_supported", "muon_apply_", "muon_momentum_",
           "muon_update_"]


def fused_supported(t: torch.Tensor) -> bool:
    """Whether ``torch._fused_adamw_`` supports tensors of this device and dtype."""
    if t.device.type == "cuda":
        return t.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    if t.device.type == "cpu":
        return t.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    return False


FUSED_MAX_SLICES: dict[str, int | None] = {"cpu": None, "cuda": None}
"""Per device type, the most slices (parameter pieces) a unit may have for ``impl='auto'`` to run
the fused kernel; a unit with more runs the foreach kernels. None: fused at every slice count.
From ``bench/optim_staged_kernels.py`` (one unit of N elements split into k equal slices, fused vs
foreach, min of interleaved runs; docs/optim_staged.md "Kernel choice"): on CPU (torch 2.11,
1 Mi elements, 1 thread, 2026-12-01) fused is faster at every k from 1 to 4096, so no limit. On
CUDA no crossover has been measured yet: fused at every k until the GPU-lane run gives one."""


def choose_adamw_impl(num_slices: int, sample: torch.Tensor, fused_max_slices: int | None = None) -> str:
    """``fused`` or ``foreach`` for one unit of ``num_slices`` pieces like ``sample``: fused where
    the device supports it and ``num_slices`` is at most ``fused_max_slices`` (None: the measured
    :data:`FUSED_MAX_SLICES` of the device)."""
    if not fused_supported(sample):
        return "foreach"
    limit = FUSED_MAX_SLICES.get(sample.device.type) if fused_max_slices is None else fused_max_slices
    return "fused" if limit is None or num_slices <= limit else "foreach"


@torch.no_grad()
def adamw_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    impl: str = "auto",
    step_value: float | None = None,
) -> None:
    """One AdamW update in place on lists of same-shaped tensors ``[N_i]``.

    ``step`` is a 0-d float32 tensor holding t (>= 1) on the compute device for ``fused``, any
    device for ``foreach``; it is read, not incremented. ``step_value`` is the same t as a Python
    number: ``foreach`` uses it for its scalar bias corrections instead of reading ``step`` back
    from the device (which would synchronize with the host). ``impl``: ``fused`` | ``foreach`` |
    ``auto`` (fused when supported).
    """
    if not params:
        return
    if impl == "auto":
        impl = "fused" if fused_supported(params[0]) else "foreach"
    if impl == "fused":
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params),
            amsgrad=False, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
            maximize=False, grad_scale=None, found_inf=None,
        )
        return
    if impl != "foreach":
        raise ValueError(f"impl={impl!r} is invalid: one of auto|fused|foreach")
    if step_value is not None:
        t = float(step_value)
    else:
        t = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bias1 = 1 - beta1**t
    bias2_sqrt = (1 - beta2**t) ** 0.5
    step_size = (lr / bias1) * -1
    n = len(params)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    # Scalar lists, as torch's foreach AdamW passes them: on CUDA `_foreach_div_` by one Scalar
    # multiplies by its reciprocal, by a ScalarList it divides, and the bits differ.
    torch._foreach_div_(denom, [bias2_sqrt] * n)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, [step_size] * n)


@torch.no_grad()
def muon_momentum_(grad: torch.Tensor, momentum_buffer: torch.Tensor, *, momentum: float,
                   nesterov: bool) -> torch.Tensor:
    """First half of a Muon step on ``[M, K]``: ``buf <- lerp(buf, g, 1 - beta)`` in place; returns
    the matrix to orthogonalize (``buf`` itself, or ``lerp(g, buf, beta)`` with Nesterov)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


@torch.no_grad()
def muon_apply_(param: torch.Tensor, orthogonalized: torch.Tensor, *, lr: float, weight_decay: float) -> None:
    """Second half of a Muon step on the fp32 master ``[M, K]``:
    ``p <- p - lr wd p; p <- p - lr O`` (decoupled weight decay, in emerging-optimizers' op order)."""
    if weight_decay != 0.0:
        param.add_(param, alpha=-weight_decay * lr)
    param.add_(orthogonalized, alpha=-lr)


@torch.no_grad()
def muon_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """One Muon update in place on a whole matrix ``param [M, K]`` (fp32 master).

    ``orthogonalize(u) -> [M, K]`` includes the scale (spectral etc.) and any TP collectives.
    """
    update = muon_momentum_(grad, momentum_buffer, momentum=momentum, nesterov=nesterov)
    muon_apply_(param, orthogonalize(update), lr=lr, weight_decay=weight_decay)
