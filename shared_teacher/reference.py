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

from shared_teacher.errors import StateBudgetExceeded

__all__ = ["SimNode", "SimStudent", "SimResult", "StateBudgetExceeded", "simulate_node", "simulate_nodes", "teacher_features_reference", "topk_distill_loss_reference"]


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
    """A stalling state, normalized: per node ``P``, per student its positions, per node the sample latch,
    the token latch and the lengths of positions ``[lo, P)``."""
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


@dataclass(frozen=True, kw_only=True)
class SimNode:
    """Admission limits and epoch size of one simulated node."""

    epoch_size: int
    """Positions per epoch on this node (``D_n``)."""
    high: int
    """Sample high watermark, also the hard cap."""
    low: int
    """Sample low watermark."""
    high_tokens: int = 0
    """Token latch (0: none)."""
    low_tokens: int = 0
    """Token low watermark."""
    byte_cap_samples: int = 0
    """Byte cap in units of ``max_sample_bytes`` (0: none; every object is assumed to be that large)."""


def simulate_node(*, students: list[SimStudent], epoch_size: int, high: int, low: int, high_tokens: int = 0,
                  low_tokens: int = 0, byte_cap_samples: int = 0, lengths: tuple[int, ...] = (1,),
                  lag_cap: int = 1 << 30, starvation_release: bool = True, max_states: int = 2_000_000) -> SimResult:
    """:func:`simulate_nodes` for one node (arguments as in :class:`SimNode`)."""
    node = SimNode(epoch_size=epoch_size, high=high, low=low, high_tokens=high_tokens, low_tokens=low_tokens,
                   byte_cap_samples=byte_cap_samples)
    return simulate_nodes(students=[(s,) for s in students], nodes=[node], lengths=lengths, lag_cap=lag_cap,
                          starvation_release=starvation_release, max_states=max_states)


def simulate_nodes(*, students: list[tuple[SimStudent, ...]], nodes: list[SimNode], lengths: tuple[int, ...] = (1,),
                   lag_cap: int = 1 << 30, starvation_release: bool = True, max_states: int = 2_000_000) -> SimResult:
    """Explore every interleaving of admission (per node) and dispatch (per student, across nodes).

    ``students[c][n]``: student ``c``'s share on node ``n``. A window needs its share on every node
    (checked in node order, like the source: an unpacked node with fewer than ``Q`` positions left in
    the epoch, or a packed node whose whole rest leaves a bin empty, drops the epoch tail on all
    nodes). ``lengths``: token lengths the data may have (each admission branches over all of them);
    ``lag_cap``: a student starts (or drops) a window only while its positions summed over nodes
    exceed the slowest's by at most this; ``starvation_release=False`` gives the plain latch.
    State: per node the next position to admit, the latches and the lengths of positions
    ``[lo_n, P_n)``; per student its position on every node; shifted by whole epochs.
    """
    nn = len(nodes)
    ds = [nd.epoch_size for nd in nodes]

    def epoch_of(pos: tuple[int, ...]) -> int:
        return min(pos[n] // ds[n] for n in range(nn))

    def share_ready(c: int, n: int, p: int, pos: tuple[int, ...], lo: int, lens: tuple[int, ...]) -> str:
        """'ready', 'tail' or 'wait' for student c's next share on node n."""
        st, x = students[c][n], pos[n]
        end = (epoch_of(pos) + 1) * ds[n]
        if not st.pack_budget:
            if x + st.quantum > end:
                return "tail"
            return "ready" if x + st.quantum <= p else "wait"
        tokens = 0
        for y in range(x, end):
            if y >= p:
                return "wait"
            tokens += lens[y - lo]
            if tokens >= st.quantum:
                return "ready"
        return "ready"  # the whole rest of the epoch is admitted

    def move(c: int, ps: tuple[int, ...], cs: tuple, los: tuple[int, ...], lens: tuple) -> tuple[int, ...] | None:
        """Positions of student c after its next window or tail drop, or None if it cannot start."""
        pos = cs[c]
        if sum(pos) - min(sum(x) for x in cs) > lag_cap:
            return None
        e = epoch_of(pos)
        tail = tuple((e + 1) * d for d in ds)
        new = list(pos)
        for n in range(nn):
            st, x, end = students[c][n], pos[n], tail[n]
            if not st.pack_budget:
                if x + st.quantum > end:
                    return tail
                if x + st.quantum > ps[n]:
                    return None
                new[n] = x + st.quantum
                continue
            ready, tokens, whole = [], 0, True
            for y in range(x, end):
                if y >= ps[n] or tokens >= st.quantum:
                    whole = False
                    break
                ready.append(lens[n][y - los[n]])
                tokens += ready[-1]
            if tokens < st.quantum and not whole:
                return None
            counts = _next_fit(ready, st.pack_budget, st.bins)
            if whole and not all(counts):
                return tail
            new[n] = x + sum(counts)
        return tuple(new)

    def norm(ps, cs, ls, lt, lens) -> tuple:
        e = min(epoch_of(pos) for pos in cs)
        shift = [e * d for d in ds]
        return (tuple(p - sh for p, sh in zip(ps, shift)), tuple(tuple(x - sh for x, sh in zip(pos, shift)) for pos in cs),
                ls, lt, lens)

    start = norm(tuple(0 for _ in nodes), tuple(tuple(0 for _ in nodes) for _ in students), (False,) * nn,
                 (False,) * nn, ((),) * nn)
    seen = {start}
    todo = deque([start])
    while todo:
        state = todo.popleft()
        ps, cs, ls, lt, lens = state
        los = tuple(min(pos[n] for pos in cs) for n in range(nn))
        nxt = []
        for n, nd in enumerate(nodes):  # admission on node n
            samples, tokens = ps[n] - los[n], sum(lens[n])
            if samples >= nd.high or (nd.byte_cap_samples and samples + 1 > nd.byte_cap_samples):
                continue
            latched = ls[n] or lt[n]
            if latched and starvation_release and any(
                    share_ready(c, n, ps[n], pos, los[n], lens[n]) == "wait" for c, pos in enumerate(cs)):
                latched = False
            if latched:
                continue
            for t in lengths:
                nxt.append((ps[:n] + (ps[n] + 1,) + ps[n + 1:], cs,
                            ls[:n] + (samples + 1 >= nd.high,) + ls[n + 1:],
                            lt[:n] + (bool(nd.high_tokens and tokens + t >= nd.high_tokens),) + lt[n + 1:],
                            lens[:n] + (lens[n] + (t,),) + lens[n + 1:]))
        for c in range(len(students)):  # dispatch: student c takes or drops a window
            m = move(c, ps, cs, los, lens)
            if m is None:
                continue
            cs2 = cs[:c] + (m,) + cs[c + 1:]
            ps2, ls2, lt2, lens2 = list(ps), list(ls), list(lt), list(lens)
            for n, nd in enumerate(nodes):
                lo2 = min(pos[n] for pos in cs2)
                if lo2 == los[n]:
                    continue
                ps2[n] = max(ps[n], lo2)
                lens2[n] = lens[n][lo2 - los[n]:] if lo2 < ps[n] else ()
                ls2[n] = ls[n] and ps2[n] - lo2 > nd.low
                lt2[n] = lt[n] and sum(lens2[n]) > nd.low_tokens
            nxt.append((tuple(ps2), cs2, tuple(ls2), tuple(lt2), tuple(lens2)))
        if not nxt:
            return SimResult(stall=True, witness=state, states=len(seen))
        for s in nxt:
            s = norm(*s)
            if s not in seen:
                if len(seen) >= max_states:
                    raise StateBudgetExceeded(f"simulate_nodes: more than max_states={max_states} states; "
                                              "shrink the config")
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
