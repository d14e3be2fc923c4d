"""Admission control per node, and the preflight that proves it cannot stall.

**Gauges.** Per node, in-flight = admitted and not yet freed (samples, tokens, bytes). A sample is
freed when every live student has settled it (acked at its optimizer step, skipped on resume or
dropped at its epoch end). Admission is a latched hysteresis per gauge: after an admission that
brings in-flight samples to ``≥ high_samples`` (tokens to ``≥ high_tokens``) the gauge pauses;
it resumes when a free brings it to ``≤ low``. A byte cap pauses admission while
``bytes + max_sample_bytes > byte_cap``, but only once at least one sample-quantum (and one
token-quantum) is in flight, so byte pressure never pauses below one quantum.

**Quanta.** Pins last until the optimizer step, so on node ``n`` an unpacked student ``c`` needs
``Q_cn = ranks_cn × micro_batch × accumulation`` samples for one window; a packed student needs
``T_cn = ranks_cn × pack_budget × accumulation`` tokens (a next-fit window is decidable once that
many tokens are ready), i.e. at most ``ceil(T_cn / min_seq_len)`` samples.

**Preflight (unpacked).** Windows of epoch ``e`` start at ``e·D_n + k·Q_cn`` for
``k < K_c = min_n floor(D_n / Q_cn)``; after ``K_c`` windows the student drops the rest of its
epoch. A stall needs ``H < max_c Q_cn`` or a remainder above the low watermark: if the slowest
student sits on a window start ``F``, admission pauses at ``P = F + H``, every student drains to
its last window start ``f_c(P) ≤ P`` (or past its epoch end) and ``max(0, P − min_c f_c(P))``
samples stay in flight. Preflight requires ``L ≥ R = max_F (F + H − min_c f_c(F + H))`` over the
window starts ``F`` of every student (``R ≤ max_c Q_cn − 1``, so ``L ≥ Q − 1`` always suffices).
:func:`shared_teacher.reference.simulate_node` explores every interleaving of the same rules; the
property tests check that with one window size per node preflight refuses exactly the configs the
simulator stalls on, and that with mixed sizes it is sound (it may refuse a config whose worst
``F`` is unreachable).

**Preflight (packed and mixed, sufficient).** With ``s = min_seq_len``, ``m = max_seq_len``:
``H_s ≥ ceil(T/s)``, ``L_s ≥ floor((T−1)/s)``; token gauge on: ``H_t ≥ T``, ``L_t ≥ T − 1`` (packed),
``H_t ≥ Q·m``, ``L_t ≥ (Q−1)·m`` (unpacked); ``m ≤ pack_budget``. Byte cap ≥
``max_c quantum_samples_c × max_sample_bytes``. Every student needs ranks on every node
(samples on a node without its readers could never be settled), and at least one window per epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared_teacher.config import NodeLimits, SourceConfig, StudentSpec
from shared_teacher.errors import AdmissionConfigError

__all__ = ["node_epoch_sizes", "windows_per_epoch", "residue_bound", "quantum_samples", "preflight",
           "NodeGate", "PreflightReport"]


def node_epoch_sizes(dataset_size: int, nodes: list[str]) -> dict[str, int]:
    """Samples per epoch on each node under round-robin placement (position p → nodes[p % N])."""
    n = len(nodes)
    return {node: dataset_size // n + (1 if i < dataset_size % n else 0) for i, node in enumerate(nodes)}


def windows_per_epoch(spec: StudentSpec, sizes: dict[str, int]) -> int:
    """Full windows an unpacked student takes per epoch: ``K = min_n floor(D_n / Q_n)``."""
    return min(sizes[n] // spec.quantum(n) for n in sizes) if all(spec.quantum(n) for n in sizes) else 0


def _drain_to(p: int, d: int, q: int, k: int) -> int:
    """Where a student with window size q and k windows per epoch ends when positions < p are produced."""
    e, r = divmod(p, d)
    j = r // q
    return (e + 1) * d if j >= k else e * d + j * q


def residue_bound(high: int, epoch_size: int, students: list[tuple[int, int]]) -> int:
    """Largest in-flight count left after a full drain from a pause (see module docstring).

    ``students`` are ``(Q, K)`` pairs (window size and windows per epoch on this node).
    """
    starts = {0}
    for q, k in students:
        starts.update(j * q for j in range(k + 1))
    worst = 0
    for f in starts:
        p = f + high
        worst = max(worst, p - min(_drain_to(p, epoch_size, q, k) for q, k in students))
    return worst


def quantum_samples(spec: StudentSpec, node: str, *, min_seq_len: int) -> int:
    """A student's per-node quantum counted in samples (packed: at most ``ceil(T / min_seq_len)``)."""
    q = spec.quantum(node)
    return math.ceil(q / min_seq_len) if spec.packed else q


@dataclass(kw_only=True)
class PreflightReport:
    """What preflight computed per node (for logs and docs)."""

    epoch_sizes: dict[str, int]
    """Samples per epoch on each node."""
    quanta: dict[str, dict[str, int]]
    """node → student → quantum (samples, or tokens for packed students)."""
    residues: dict[str, int]
    """node → worst remainder after a drain (unpacked students; 0 if none)."""


def preflight(config: SourceConfig) -> PreflightReport:
    """Prove admission and dispatch can always progress; raise :class:`AdmissionConfigError` otherwise.

    All failing checks are collected; the error lists ``node, student, check, need, have`` for each.
    """
    nodes = list(config.nodes)
    sizes = node_epoch_sizes(config.dataset_size, nodes)
    bad: list[dict] = []

    def need(node: str, student: str, check: str, want: int, have: int) -> None:
        if have < want:
            bad.append({"node": node, "student": student, "check": check, "need": want, "have": have})

    quanta: dict[str, dict[str, int]] = {n: {} for n in nodes}
    residues: dict[str, int] = {}
    for s in config.students:
        for n in nodes:
            need(n, s.name, "ranks_on_node", 1, s.ranks_per_node.get(n, 0))
            quanta[n][s.name] = s.quantum(n)
    if bad:
        raise _error(bad)
    windows = {s.name: windows_per_epoch(s, sizes) for s in config.students if not s.packed}
    for s in config.students:
        if s.packed:
            need("*", s.name, "pack_budget_tokens >= max_seq_len", config.max_seq_len, s.pack_budget_tokens)
        else:
            need("*", s.name, "windows_per_epoch", 1, windows[s.name])
    for n in nodes:
        lim: NodeLimits = config.nodes[n]
        unpacked = [s for s in config.students if not s.packed]
        packed = [s for s in config.students if s.packed]
        for s in unpacked:
            q = s.quantum(n)
            need(n, s.name, "high_samples >= quantum", q, lim.high_samples)
            if lim.high_tokens:
                need(n, s.name, "high_tokens >= quantum*max_seq_len", q * config.max_seq_len, lim.high_tokens)
                need(n, s.name, "low_tokens >= (quantum-1)*max_seq_len", (q - 1) * config.max_seq_len, lim.low_tokens)
        for s in packed:
            t = s.quantum(n)
            need(n, s.name, "high_samples >= ceil(quantum_tokens/min_seq_len)",
                 math.ceil(t / config.min_seq_len), lim.high_samples)
            need(n, s.name, "low_samples >= floor((quantum_tokens-1)/min_seq_len)",
                 (t - 1) // config.min_seq_len, lim.low_samples)
            if lim.high_tokens:
                need(n, s.name, "high_tokens >= quantum_tokens", t, lim.high_tokens)
                need(n, s.name, "low_tokens >= quantum_tokens-1", t - 1, lim.low_tokens)
        if unpacked and lim.high_samples >= max(s.quantum(n) for s in unpacked) and all(windows.values()):
            r = residue_bound(lim.high_samples, sizes[n], [(s.quantum(n), windows[s.name]) for s in unpacked])
            residues[n] = r
            worst = max(unpacked, key=lambda s: s.quantum(n)).name
            need(n, worst, "low_samples >= remainder after drain", r, lim.low_samples)
        else:
            residues[n] = 0
        if lim.byte_cap:
            qs = max(quantum_samples(s, n, min_seq_len=config.min_seq_len) for s in config.students)
            who = max(config.students, key=lambda s: quantum_samples(s, n, min_seq_len=config.min_seq_len)).name
            need(n, who, "byte_cap >= quantum_samples*max_sample_bytes", qs * config.max_sample_bytes, lim.byte_cap)
    if bad:
        raise _error(bad)
    return PreflightReport(epoch_sizes=sizes, quanta=quanta, residues=residues)


def _error(bad: list[dict]) -> AdmissionConfigError:
    lines = [f"node {b['node']!r} student {b['student']!r}: {b['check']}: need {b['need']}, have {b['have']}"
             for b in bad]
    return AdmissionConfigError("admission preflight failed (progress not guaranteed):\n  " + "\n  ".join(lines), bad)


class NodeGate:
    """Runtime admission state of one node (the rules the preflight and the simulator assume)."""

    def __init__(self, limits: NodeLimits, *, quantum_samples: int, quantum_tokens: int,
                 max_sample_bytes: int) -> None:
        self.limits = limits
        self.quantum_samples = quantum_samples
        self.quantum_tokens = quantum_tokens
        self.max_sample_bytes = max_sample_bytes
        self.samples = 0
        self.tokens = 0
        self.bytes = 0
        self.paused_samples = False
        self.paused_tokens = False

    @property
    def byte_blocked(self) -> bool:
        lim = self.limits
        return bool(lim.byte_cap) and self.bytes + self.max_sample_bytes > lim.byte_cap and \
            self.samples >= self.quantum_samples and self.tokens >= self.quantum_tokens

    def can_admit(self) -> bool:
        return not (self.paused_samples or self.paused_tokens or self.byte_blocked)

    def admit(self, tokens: int) -> None:
        """Count one admitted sample; bytes are reserved at ``max_sample_bytes`` until published."""
        self.samples += 1
        self.tokens += tokens
        self.bytes += self.max_sample_bytes
        if self.samples >= self.limits.high_samples:
            self.paused_samples = True
        if self.limits.high_tokens and self.tokens >= self.limits.high_tokens:
            self.paused_tokens = True

    def publish(self, nbytes: int) -> None:
        """Replace the reservation of one sample by its stored size."""
        self.bytes += nbytes - self.max_sample_bytes

    def free(self, tokens: int, nbytes: int) -> None:
        self.samples -= 1
        self.tokens -= tokens
        self.bytes -= nbytes
        if self.paused_samples and self.samples <= self.limits.low_samples:
            self.paused_samples = False
        if self.paused_tokens and self.tokens <= self.limits.low_tokens:
            self.paused_tokens = False

    def snapshot(self) -> dict:
        return {"in_flight_samples": self.samples, "in_flight_tokens": self.tokens, "in_flight_bytes": self.bytes,
                "paused_samples": self.paused_samples, "paused_tokens": self.paused_tokens,
                "byte_blocked": self.byte_blocked}
