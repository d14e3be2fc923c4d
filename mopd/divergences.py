"""Full-vocabulary and top-k divergences between student logits and teacher log-probs.

Per row (token) with student log-probs s = log_softmax(z / τ) and teacher log-probs t:

* forward KL:  KL(T‖S) = Σ_v e^{t_v} (t_v − s_v)
* reverse KL:  KL(S‖T) = Σ_v e^{s_v} (s_v − t_v)
* JSD(β):      M = (1−β)·S + β·T,   β·KL(T‖M) + (1−β)·KL(S‖M)  for 0 < β < 1;
               β = 0 is defined as forward KL and β = 1 as reverse KL (the convention of
               TRL's generalized JSD; the interpolation itself tends to 0 at both ends).

Teacher log-probs may be −inf (probability 0). Forward KL and JSD(0 < β < 1) stay exact and
finite (0·log 0 = 0; M has the student's support). Reverse KL (and JSD(β = 1)) is +∞ as soon as
the teacher gives probability 0 to a token the student can sample, which for finite student
logits is every such token. It is therefore computed against the teacher floored at
``TEACHER_LOGP_FLOOR`` = log 2^−126 ≈ −87.34 (float32's smallest normal probability):

    KL_f(S‖T) = Σ_v e^{s_v} (s_v − max(t_v, f))

equal to KL(S‖T) wherever t ≥ f, finite, with finite gradients that push the student's mass
off the teacher's impossible tokens (each such token costs at most e^{s_v}(s_v − f)). The same
floor applies to a top-k ``bucket`` tail of zero mass (top-k mass rounded to 1).

Top-k: the teacher supplies ids ``[N, k]`` and their log-probs under its full distribution.
``bucket`` compares the (k+1)-category distributions {top-k ids, everything else} (exact KL /
JSD of those coarsened distributions; equals the full divergence when k = V); ``renorm``
compares both distributions renormalized over the k ids.

Rows are processed in chunks of ``chunk_rows``: the loss and d loss / d logits of a chunk are
computed in the forward (one ``[chunk, V]`` working set), the gradient is kept in one
``[N, V]`` buffer and scaled in the backward. Inactive rows are zeroed before any ``exp`` and
contribute nothing; NaN/inf in an active row raises. Returns ``(loss_sum, num_rows)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mopd.config import DivergenceConfig
from mopd.errors import NonFiniteInputError

__all__ = ["TEACHER_LOGP_FLOOR", "full_vocab_divergence", "topk_divergence", "row_divergence"]

TEACHER_LOGP_FLOOR = -126.0 * math.log(2.0)
"""log 2^−126: teacher log-probs below it (−inf included) count as this in reverse KL."""


def _kl(p_log: torch.Tensor, q_log: torch.Tensor, *, p_finite: bool = False) -> torch.Tensor:
    """Σ_v e^{p} (p − q) over the last dim, with 0·log 0 = 0 (p = −inf entries dropped unless
    the caller knows ``p_log`` is finite, e.g. a student log-softmax of finite logits)."""
    p = p_log.exp()
    diff = p_log - q_log
    if not p_finite:
        diff = torch.where(p > 0, diff, torch.zeros_like(diff))
    return (p * diff).sum(-1)


def row_divergence(s: torch.Tensor, t: torch.Tensor, *, kind: str, beta: float) -> torch.Tensor:
    """Divergence per row between log-prob rows ``s`` (student, finite) and ``t`` (teacher,
    may hold −inf), ``[N, C]`` → ``[N]``. Reverse KL reads ``t`` through
    ``max(t, TEACHER_LOGP_FLOOR)`` (module docstring)."""
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return _kl(t, s)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return _kl(s, t.clamp(min=TEACHER_LOGP_FLOOR), p_finite=True)
    if kind == "jsd":
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        return beta * _kl(t, m) + (1.0 - beta) * _kl(s, m, p_finite=True)
    raise ValueError(f"kind must be forward_kl, reverse_kl or jsd, got {kind!r}")


def _check_rows(name: str, x: torch.Tensor, m: torch.Tensor, offset: int, *, need_mass: bool = False) -> None:
    """Raise :class:`NonFiniteInputError` if an active row of this chunk has NaN/inf (−inf is
    allowed in teacher log-probs: probability 0), or, with ``need_mass``, has no entry above
    −inf (a teacher row without probability mass cannot be normalized)."""
    ok = (~torch.isnan(x) & (x != math.inf)) if name == "teacher_logp" else torch.isfinite(x)
    bad = m & ~ok.all(-1)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        c = int((~ok[r]).nonzero()[0, 0])
        raise NonFiniteInputError(f"{name} is non-finite at active position ({offset + r}, {c}) "
                                  f"(value {x[r, c].item()!r})")
    if need_mass:
        empty = m & ~(x > -math.inf).any(-1)
        if bool(empty.any()):
            raise NonFiniteInputError(f"{name} row {offset + int(empty.nonzero()[0, 0])} is active but every "
                                      "entry is -inf (no probability mass)")


class _ChunkedRowLoss(torch.autograd.Function):
    """Σ_rows f(logits_row, teacher_rows) over active rows, gradient formed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, logits, mask, chunk_rows, fn, teacher):
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if need_grad else None
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        all_active = bool(mask.all())
        for i in range(0, logits.shape[0], chunk_rows):
            j = min(i + chunk_rows, logits.shape[0])
            m = mask[i:j]
            dense = all_active or bool(m.all())
            with torch.enable_grad():
                z = logits[i:j].detach().requires_grad_(need_grad)
                per_row = fn(z, m, dense, i, *(x[i:j] for x in teacher))
                chunk = (per_row if dense else torch.where(m, per_row, torch.zeros_like(per_row))).sum()
                if need_grad:
                    (g,) = torch.autograd.grad(chunk, z)
                    grad[i:j] = g
            total += chunk.detach().to(torch.float64)
        ctx.save_for_backward(grad)
        return total.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None, None, None


def _run(logits: torch.Tensor, mask: torch.Tensor, chunk_rows: int, fn: Callable, *teacher: torch.Tensor):
    return _ChunkedRowLoss.apply(logits, mask, chunk_rows, fn, teacher)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _prep(student_logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if student_logits.dim() != 2:
        raise ValueError(f"student_logits must be [N, V], got shape {tuple(student_logits.shape)}")
    n = student_logits.shape[0]
    if mask is None:
        return torch.ones(n, dtype=torch.bool, device=student_logits.device)
    if mask.shape != (n,):
        raise ValueError(f"mask must be [N]={n}, got shape {tuple(mask.shape)}")
    return mask.bool()


def full_vocab_divergence(student_logits: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor | None = None,
                          *, config: DivergenceConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary divergence summed over active rows.

    Args:
        student_logits: ``[N, V]`` raw logits (divided by ``config.temperature`` here).
        teacher_logp: ``[N, V]`` teacher log-probs (or logits: they are re-normalized by
            ``log_softmax``), detached.
        mask: ``[N]`` bool, active rows (default all).
        config: ``kind``, ``beta``, ``temperature``, ``chunk_rows``.

    Returns ``(loss_sum, num_rows)``; ``loss_sum`` is differentiable w.r.t. ``student_logits``.
    """
    mask = _prep(student_logits, mask)
    if teacher_logp.shape != student_logits.shape:
        raise ValueError(f"teacher_logp shape {tuple(teacher_logp.shape)} != student_logits {tuple(student_logits.shape)}")
    tau, kind, beta, check = config.temperature, config.kind, config.beta, config.check_finite

    def fn(z, m, dense, offset, t):
        if check:
            _check_rows("student_logits", z.detach(), m, offset)
            _check_rows("teacher_logp", t, m, offset, need_mass=True)
        z, t = _upcast(z), _upcast(t.detach())
        if not dense:
            z = torch.where(m[:, None], z, torch.zeros_like(z))
            t = torch.where(m[:, None], t, torch.zeros_like(t))
        return row_divergence(torch.log_softmax(z / tau, -1), torch.log_softmax(t, -1), kind=kind, beta=beta)

    return _run(student_logits, mask, config.chunk_rows, fn, teacher_logp), mask.sum()


def topk_divergence(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
                    mask: torch.Tensor | None = None, *, config: DivergenceConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k divergence summed over active rows.

    Args:
        student_logits: ``[N, V]`` raw logits (divided by ``config.temperature`` here).
        teacher_ids: ``[N, k]`` distinct token ids per row.
        teacher_logp: ``[N, k]`` teacher log-probs of those ids under its full distribution.
        mask: ``[N]`` bool, active rows (default all).
        config: ``kind``, ``beta``, ``temperature``, ``top_k_tail``, ``chunk_rows``.

    Returns ``(loss_sum, num_rows)``.
    """
    mask = _prep(student_logits, mask)
    n, v = student_logits.shape
    if teacher_ids.dim() != 2 or teacher_ids.shape[0] != n or teacher_logp.shape != teacher_ids.shape:
        raise ValueError(f"teacher_ids {tuple(teacher_ids.shape)} and teacher_logp {tuple(teacher_logp.shape)} "
                         f"must both be [N={n}, k]")
    k = teacher_ids.shape[1]
    if k > v:
        raise ValueError(f"top-k width k={k} exceeds vocabulary V={v}")
    bad_ids = mask[:, None] & ((teacher_ids < 0) | (teacher_ids >= v))
    if bool(bad_ids.any()):
        idx = tuple(bad_ids.nonzero()[0].tolist())
        raise ValueError(f"teacher_ids out of range [0, {v}) at active position {idx}: {teacher_ids[idx].item()}")
    tau, kind, beta, tail, check = config.temperature, config.kind, config.beta, config.top_k_tail, config.check_finite

    def fn(z, m, dense, offset, ids, t):
        if check:
            _check_rows("student_logits", z.detach(), m, offset)
            _check_rows("teacher_logp", t, m, offset, need_mass=tail == "renorm")
        z, t = _upcast(z), _upcast(t.detach())
        if not dense:
            z = torch.where(m[:, None], z, torch.zeros_like(z))
            ids = torch.where(m[:, None], ids, torch.arange(k, device=ids.device).expand_as(ids))
            t = torch.where(m[:, None], t, torch.full_like(t, -math.log(v)))
        s_full = torch.log_softmax(z / tau, -1)
        s = s_full.gather(-1, ids)
        if tail == "renorm":
            return row_divergence(s - s.logsumexp(-1, keepdim=True), t - t.logsumexp(-1, keepdim=True),
                                  kind=kind, beta=beta)
        if k == v:
            return row_divergence(s, t, kind=kind, beta=beta)
        in_topk = torch.zeros_like(s_full, dtype=torch.bool).scatter_(-1, ids, True)
        s_tail = torch.where(in_topk, torch.full_like(s_full, -math.inf), s_full).logsumexp(-1, keepdim=True)
        t_mass = t.exp().sum(-1, keepdim=True)
        t_tail = torch.log((1.0 - t_mass).clamp(min=0.0))
        return row_divergence(torch.cat([s, s_tail], -1), torch.cat([t, t_tail], -1), kind=kind, beta=beta)

    return _run(student_logits, mask, config.chunk_rows, fn, teacher_ids, teacher_logp), mask.sum()
