"""Plain references: an exhaustive discrete-event simulator of admission/dispatch on one node, and
fp64 teacher features from logits.

The simulator is the oracle of :func:`shared_teacher.admission.preflight`: it applies the same
rules as :class:`~shared_teacher.admission.NodeGate` (hard caps, latched watermarks, starvation
release) and the source's dispatcher (unpacked windows of ``Q`` samples with the epoch tail
dropped; packed windows formed by next-fit once ``T`` tokens or the whole epoch rest are ready; the
lag cap) to every interleaving of "admit one sample of any allowed length" and "student c takes /
drops a window", over an endless stream of epochs, and reports whether some reachable state has no
enabled event (a stall).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

__all__ = ["SimStudent", "SimResult", "simulate_node", "teacher_features_reference", "topk_distill_loss_reference"]


@dataclass(frozen=True, kw_only=True)
class SimStudent:
    """One student on the simulated node."""

    quantum: int
    """Unpacked: samples per window (``Q``). Packed: tokens per window (``T = bins × pack_budget``)."""
    pack_budget: int = 0
    """Tokens per packed micro-batch (0: unpacked)."""
    bins: int = 1
    """Packed micro-batches per window on this node (ranks × accumulation steps)."""


@dataclass(kw_only=True)
class SimResult:
    """Outcome of :func:`simulate_node`."""

    stall: bool
    """Some reachable state has no enabled event."""
    witness: tuple | None
    """A stalling state ``(P, positions, latched_samples, latched_tokens, lengths in flight)``, normalized."""
    states: int
    """Distinct states explored."""


def _next_fit(lengths: list[int], budget: int, bins: int) -> list[int]:
    """Items per bin when ``lengths`` are packed in order into ``bins`` bins of ``budget`` tokens."""
    counts, b, used = [0] * bins, 0, 0
    for t in lengths:
        if used + t > budget:
            b, used = b + 1, 0
            if b == bins:
                break
        counts[b] += 1
        used += t
    return counts


def simulate_node(*, students: list[SimStudent], epoch_size: int, high: int, low: int, high_tokens: int = 0,
                  low_tokens: int = 0, byte_cap_samples: int = 0, lengths: tuple[int, ...] = (1,),
                  lag_cap: int = 1 << 30, starvation_release: bool = True, max_states: int = 2_000_000) -> SimResult:
    """Explore every interleaving of admission and dispatch on one node.

    ``high``/``low``: sample watermarks (``high`` is also the hard cap); ``high_tokens``/``low_tokens``:
    token latch (0: none); ``byte_cap_samples``: byte cap in units of ``max_sample_bytes`` (0: none;
    every object is assumed to be that large); ``lengths``: token lengths the data may have (each
    admission branches over all of them); ``lag_cap``: a student starts (or drops) a window only
    while its position exceeds the slowest's by at most this; ``starvation_release=False`` gives the
    plain latch (for the regression it fixes). State: next position to admit ``P``, every student's
    settled prefix, the two latches and the lengths of positions ``[lo, P)``, shifted by whole epochs.
    """
    d = epoch_size

    def move(i: int, p: int, cs: tuple[int, ...], lens: tuple[int, ...]) -> int | None:
        """New position of student i after its next window or tail drop, or None if it cannot start."""
        st, c, lo = students[i], cs[i], min(cs)
        if c - lo > lag_cap:
            return None
        e = c // d
        end = (e + 1) * d
        if not st.pack_budget:
            if c + st.quantum > end:
                return end
            return c + st.quantum if c + st.quantum <= p else None
        ready, tokens, whole = [], 0, True
        for pos in range(c, end):
            if pos >= p or tokens >= st.quantum:
                whole = False
                break
            ready.append(lens[pos - lo])
            tokens += ready[-1]
        if tokens < st.quantum and not whole:
            return None
        counts = _next_fit(ready, st.pack_budget, st.bins)
        if whole and not all(counts):
            return end
        return c + sum(counts)

    def norm(p: int, cs: tuple[int, ...], ls: bool, lt: bool, lens: tuple[int, ...]) -> tuple:
        shift = (min(cs) // d) * d
        return (p - shift, tuple(c - shift for c in cs), ls, lt, lens)

    start = norm(0, tuple(0 for _ in students), False, False, ())
    seen = {start}
    todo = deque([start])
    while todo:
        state = todo.popleft()
        p, cs, ls, lt, lens = state
        lo = min(cs)
        samples, tokens = p - lo, sum(lens)
        moves = [move(i, p, cs, lens) for i in range(len(students))]
        nxt = []
        hard = samples >= high or (byte_cap_samples and samples + 1 > byte_cap_samples)
        starving = any(c == lo and m is None for c, m in zip(cs, moves))
        if starvation_release and starving and not hard:
            ls = lt = False
        if not hard and not ls and not lt:
            for t in lengths:
                nxt.append((p + 1, cs, samples + 1 >= high, lt or bool(high_tokens and tokens + t >= high_tokens),
                            lens + (t,)))
        for i, m in enumerate(moves):
            if m is None:
                continue
            cs2 = cs[:i] + (m,) + cs[i + 1:]
            lo2 = min(cs2)
            if lo2 == lo:
                nxt.append((p, cs2, ls, lt, lens))
                continue
            p2 = max(p, lo2)
            lens2 = lens[lo2 - lo:] if lo2 < p else ()
            nxt.append((p2, cs2, ls and p2 - lo2 > low, lt and sum(lens2) > low_tokens, lens2))
        if not nxt:
            return SimResult(stall=True, witness=state, states=len(seen))
        for s in nxt:
            s = norm(*s)
            if s not in seen:
                if len(seen) >= max_states:
                    raise RuntimeError(f"simulate_node: more than max_states={max_states} states; shrink the config")
                seen.add(s)
                todo.append(s)
    return SimResult(stall=False, witness=None, states=len(seen))


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
