"""Plain references: an exhaustive discrete-event simulator of admission/dispatch on one node, and
fp64 teacher features from logits.

The simulator is the oracle of :func:`shared_teacher.admission.preflight`: it applies the same
rules as :class:`~shared_teacher.admission.NodeGate` and the source's dispatcher to every
interleaving of "admit one sample" and "student c takes / drops a window", over an endless
stream of epochs, and reports whether some reachable state has no enabled event (a stall) or
whether the byte cap can be exceeded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

__all__ = ["SimResult", "simulate_node", "teacher_features_reference", "topk_distill_loss_reference"]


@dataclass(kw_only=True)
class SimResult:
    """Outcome of :func:`simulate_node`."""

    stall: bool
    """Some reachable state has no enabled event."""
    overflow: bool
    """Some reachable admission exceeds the byte cap."""
    witness: tuple | None
    """A stalling (or overflowing) state ``(produced, positions, paused)``, normalized."""
    states: int
    """Distinct states explored."""


def simulate_node(*, windows: list[tuple[int, int]], epoch_size: int, high: int, low: int,
                  byte_cap_samples: int = 0, lag_cap: int = 1 << 30, max_states: int = 2_000_000) -> SimResult:
    """Explore every interleaving of admission and dispatch on one node (unpacked students).

    ``windows``: per student ``(Q, K)``: window size and full windows per epoch (then the rest of
    the epoch is dropped). ``high``/``low``: latched sample watermarks. ``byte_cap_samples``: byte
    cap in units of one sample's bytes (0: none); it blocks admission only while at least
    ``max Q`` samples are in flight. ``lag_cap``: a student may start a window only while its
    position exceeds the slowest's by at most this. State: ``(P, c_1..c_m, paused)`` with ``P``
    the next position to produce and ``c_i`` student i's settled prefix, shifted by whole epochs.
    """
    d = epoch_size
    qmax = max(q for q, _ in windows)

    def norm(p: int, cs: tuple[int, ...], paused: bool) -> tuple:
        lo = min(cs)
        p = max(p, lo)  # positions every student already dropped are never produced
        shift = (lo // d) * d
        return (p - shift, tuple(c - shift for c in cs), paused)

    start = norm(0, tuple(0 for _ in windows), False)
    seen = {start}
    todo = deque([start])
    while todo:
        state = todo.popleft()
        p, cs, paused = state
        lo = min(cs)
        inflight = p - lo
        nxt = []
        # admission of position p
        blocked = byte_cap_samples and inflight + 1 > byte_cap_samples and inflight >= qmax
        if not paused and not blocked:
            if byte_cap_samples and inflight + 1 > byte_cap_samples:
                return SimResult(stall=False, overflow=True, witness=state, states=len(seen))
            p2 = p + 1
            nxt.append((p2, cs, paused or p2 - lo >= high))
        # students
        for i, (q, k) in enumerate(windows):
            c = cs[i]
            e, r = divmod(c, d)
            if r // q >= k:  # epoch done: drop the rest (no production needed)
                c2 = (e + 1) * d
            elif c + q <= p and c - lo <= lag_cap:
                c2 = c + q
            else:
                continue
            cs2 = cs[:i] + (c2,) + cs[i + 1:]
            lo2 = min(cs2)
            freed = lo2 > lo  # the gate re-checks the low watermark only when something is freed
            nxt.append((p, cs2, paused and not (freed and max(p, lo2) - lo2 <= low)))
        if not nxt:
            return SimResult(stall=True, overflow=False, witness=state, states=len(seen))
        for s in nxt:
            s = norm(*s)
            if s not in seen:
                if len(seen) >= max_states:
                    raise RuntimeError(f"simulate_node: more than max_states={max_states} states; shrink the config")
                seen.add(s)
                todo.append(s)
    return SimResult(stall=False, overflow=False, witness=None, states=len(seen))


def teacher_features_reference(logits: torch.Tensor, tokens: torch.Tensor, *, top_k: int) -> dict[str, torch.Tensor]:
    """fp64 teacher features of one sequence, written position by position.

    Args:
        logits: ``[L, V]`` teacher logits of one sequence.
        tokens: ``[L]`` its token ids.
        top_k: number of top log-probs per position (0: none).

    Returns ``logprobs [L-1]`` with ``logprobs[t] = log softmax(logits[t])[tokens[t+1]]`` and, if
    ``top_k``, ``topk_logprobs [L, k]`` / ``topk_ids [L, k]`` (descending, ties by lower id).
    """
    lg = logits.to(torch.float64)
    n, v = lg.shape
    lp = []
    vals, ids = [], []
    for t in range(n):
        row = lg[t]
        m = row.max()
        lse = m + torch.log(torch.exp(row - m).sum())
        logp = row - lse
        if t + 1 < n:
            lp.append(logp[tokens[t + 1]])
        if top_k:
            order = sorted(range(v), key=lambda j: (-logp[j].item(), j))[:top_k]
            ids.append(torch.tensor(order))
            vals.append(logp[order])
    out = {"logprobs": torch.stack(lp) if lp else torch.zeros(0, dtype=torch.float64)}
    if top_k:
        out["topk_logprobs"] = torch.stack(vals)
        out["topk_ids"] = torch.stack(ids)
    return out


def topk_distill_loss_reference(student_logits: torch.Tensor, topk_ids: torch.Tensor,
                                topk_logprobs: torch.Tensor) -> torch.Tensor:
    """fp64 loop: ``Σ_t −Σ_k p̂_{t,k} log q_t(id_{t,k})`` for one sequence (``[L, V]``, ``[L, k]``, ``[L, k]``)."""
    total = torch.zeros((), dtype=torch.float64)
    for t in range(student_logits.shape[0]):
        row = student_logits[t].to(torch.float64)
        logq = row - torch.logsumexp(row, dim=0)
        w = torch.exp(topk_logprobs[t].to(torch.float64))
        w = w / w.sum()
        for j in range(topk_ids.shape[1]):
            total = total - w[j] * logq[topk_ids[t, j]]
    return total
