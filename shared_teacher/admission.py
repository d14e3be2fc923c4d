"""Admission control per node, and the preflight that proves it cannot stall.

**Gauges.** Per node, in-flight = admitted and not yet freed (samples, tokens, bytes; a sample's
bytes are reserved at ``max_sample_bytes`` until its object is published). A sample is freed when
every live student has settled it (acked at its optimizer step, skipped on resume or dropped at
its epoch end).

**Rules** (:class:`NodeGate`; the source evaluates starvation):

1. *Hard caps.* A sample is admitted only while ``samples < high_samples`` and
   ``bytes + max_sample_bytes ≤ byte_cap`` (if set). Nothing overrides these; they bound memory.
2. *Hysteresis latches.* An admission that brings samples to ``≥ high_samples`` (tokens to
   ``≥ high_tokens``) latches a pause; a free that brings the gauge to ``≤ low`` clears it.
3. *Starvation release.* The node is *starving* when some live student's next window share on it
   is not admitted yet (its window waits on this node). A starving node clears its latches
   (checked at every admission attempt, so after every admission, dispatch, ack and free).

**Why rule 3.** With a plain latch, a drain can stop with ``low < in-flight < Q`` (e.g.
``H = 250, Q = 64``: 58 samples remain after three windows, ``L < 58`` waits forever), and with
several window sizes, packed token counts and a lag cap the reachable remainders have no simple
closed form. With rule 3 a latch never holds a node some student waits on, so the only way to
stall is a *hard cap*, which gives an exact condition.

**Exact condition.** Let ``C_n = min(high_samples, floor(byte_cap / max_sample_bytes))``
(``byte_cap = 0``: no byte term) and, for student ``c`` on node ``n``,
``need_cn = Q_cn = ranks_cn × micro_batch × accumulation`` samples (unpacked) or
``need_cn = ceil(T_cn / min_seq_len)`` with ``T_cn = ranks_cn × pack_budget × accumulation``
tokens (packed: a window forms once ``T_cn`` tokens are admitted). On one node, admission and
dispatch can always progress **iff** ``C_n ≥ need_cn`` for every student.
*Necessary:* at the start every student sits at ``lo = 0``; admission stops at ``C_n`` samples; if
all have ``min_seq_len`` tokens a student with ``need_cn > C_n`` cannot start, keeps ``lo = 0`` and
nothing is ever freed. *Sufficient:* at a stall the student at ``lo`` cannot start, so it waits on
the node, which is starving: its latches are clear and only a hard cap can block, with
``≥ C_n ≥ need_cn`` samples admitted from ``lo`` — the student's whole share. The lag cap never
holds back the slowest student. Low watermarks, token watermarks and the lag cap therefore impose
no condition. :func:`shared_teacher.reference.simulate_node` explores every interleaving and every
sequence of lengths; the tests check the equivalence.

**Several nodes.** A window needs its share on every node, so students' positions couple across
nodes and can drift apart differently on each (``a`` reads 1:3 from two nodes, ``b`` 3:1: after
``k`` windows each, ``a`` trails ``b`` by ``2k`` on the first node and leads by ``2k`` on the
second). The per-node condition is still necessary, not sufficient. Preflight adds a *skew bound*
and requires, for every node ``n`` and student ``c``,

    ``C_n ≥ need_cn + S_cn``,  ``S_cn = max(0, max_{b≠c} skew(c, b, n))``

where ``skew(c, b, n)`` bounds ``x_cn − x_bn`` (node positions) over states in which ``c`` waits on
``n``, ``b`` is in the same epoch and ``adv_b ≥ adv_c`` (``adv``: positions passed this epoch,
summed over nodes). Bounds used (``D_n`` epoch size on ``n``, ``R_n = Σ_{m≠n} D_m``, unpacked
``q = Q_cn``, ``W = Σ_m Q_cm``, ``K`` windows per epoch; an unpacked student after ``k`` windows
sits at ``k·Q`` on every node):

* ``c`` unpacked: ``x_cn = k·q_c`` with ``k ≤ min(K_c, floor(D_n/q_c) − 1)`` (its share on ``n``
  fits the epoch, else it is a tail drop, not a wait). ``b`` unpacked: smallest ``k_b`` with
  ``k_b·W_b ≥ k·W_c`` (``≤ K_b``), skew ``k·q_c − ceil(k·W_c/W_b)·q_b``; ``b`` packed:
  ``x_bn ≥ adv_b − R_n``, skew ``k·q_c − max(0, k·W_c − R_n)``.
* ``c`` packed: ``x_cn ≤ D_n − 1``; against unpacked ``b`` skew ``a − ceil(a/W_b)·q_b`` for
  ``a ≤ min(D_n − 1, K_b·W_b)``; against packed ``b``, ``min(D_n − 1, R_n)``.

*Proof that the condition suffices.* Take a stall and ``s`` the student with the smallest
positions summed over nodes; the lag cap never holds it, so it waits on some node ``n``. A node
some student waits on has its latches released, so it is at a hard cap: ``P_n − lo_n ≥ C_n``,
while ``P_n − x_sn ≤ need_sn − 1``. Hence the student ``b`` at ``lo_n`` trails ``s`` on ``n`` by
``≥ C_n − need_sn + 1 ≥ 1``, and ``Σ_m x_bm ≥ Σ_m x_sm`` by the choice of ``s``. If ``b`` were in
an earlier epoch all its positions would be ``≤`` those of ``s`` and one strictly smaller;
in a later epoch it could not trail on ``n``. So both are in one epoch and
``C_n − need_sn + 1 ≤ skew(s, b, n) ≤ S_sn``, contradicting the condition. ∎

On one node, and when all students are unpacked with per-node quanta proportional across nodes
(``Q_cn = g_c·h_n``, :attr:`PreflightReport.same_order_on_all_nodes`), every skew is ``≤ 0``, so
the condition *is* the exact per-node one. Elsewhere it is sufficient only; a config that passes
the per-node checks but not this one raises :class:`~shared_teacher.errors.CrossNodeSkewError`
unless ``SourceConfig.allow_unproven_layout`` is set (then preflight warns and the watchdog turns
a stall into :class:`~shared_teacher.errors.SourceStalledError`). The argument, like
:func:`shared_teacher.reference.simulate_nodes`, models students that start an epoch together;
resume skip sets are not part of it.

Structural checks: every student has ranks on every node (samples on a node without its readers
could never be settled); an unpacked student gets at least one window per epoch on every node;
a packed one has ``max_seq_len ≤ pack_budget_tokens`` and ``D_n × min_seq_len ≥ T_cn`` (an epoch
holds at least one window's tokens).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from shared_teacher.config import NodeLimits, SourceConfig, StudentSpec
from shared_teacher.errors import AdmissionConfigError, CrossNodeSkewError, PublishError

__all__ = ["node_epoch_sizes", "windows_per_epoch", "need_samples", "admission_capacity", "cross_node_skew",
           "preflight",
           "NodeGate", "PreflightReport"]


def node_epoch_sizes(dataset_size: int, nodes: list[str]) -> dict[str, int]:
    """Samples per epoch on each node under round-robin placement (position p → nodes[p % N])."""
    n = len(nodes)
    return {node: dataset_size // n + (1 if i < dataset_size % n else 0) for i, node in enumerate(nodes)}


def windows_per_epoch(spec: StudentSpec, sizes: dict[str, int]) -> int:
    """Full windows an unpacked student takes per epoch: ``K = min_n floor(D_n / Q_n)``."""
    return min(sizes[n] // spec.quantum(n) for n in sizes) if all(spec.quantum(n) for n in sizes) else 0


def need_samples(spec: StudentSpec, node: str, *, min_seq_len: int, epoch_size: int) -> int:
    """Samples that must be admitted from a student's position before it can surely start a window.

    Unpacked: ``Q``. Packed: ``min(ceil(T / min_seq_len), D_n)`` (``T`` tokens, or the epoch's rest;
    preflight also requires ``D_n × min_seq_len ≥ T``, so this is ``ceil(T / min_seq_len)``).
    """
    q = spec.quantum(node)
    return min(math.ceil(q / min_seq_len), epoch_size) if spec.packed else q


def admission_capacity(limits: NodeLimits, *, max_sample_bytes: int) -> int:
    """``C = min(high_samples, floor(byte_cap / max_sample_bytes))``: samples the hard caps always allow."""
    cap = limits.high_samples
    if limits.byte_cap:
        cap = min(cap, limits.byte_cap // max_sample_bytes)
    return cap


@dataclass(kw_only=True)
class PreflightReport:
    """What preflight computed per node (for logs and docs)."""

    epoch_sizes: dict[str, int]
    """Samples per epoch on each node."""
    quanta: dict[str, dict[str, int]]
    """node → student → quantum (samples, or tokens for packed students)."""
    needs: dict[str, dict[str, int]]
    """node → student → samples needed from its position to start a window (``need_cn``)."""
    capacity: dict[str, int]
    """node → ``C_n`` (samples the hard caps always admit)."""
    same_order_on_all_nodes: bool
    """True when one node, or all students unpacked with per-node quanta proportional across nodes:
    then every skew is 0 and the condition is exact (see the module docstring)."""
    skew: dict[str, dict[str, int]] = field(default_factory=dict)
    """node → student → ``S_cn``, the cross-node skew bound (0 on one node and same-order layouts)."""
    proven: bool = True
    """Progress is proven (``C_n ≥ need_cn + S_cn`` everywhere). False only with
    ``allow_unproven_layout``; then :attr:`unproven` lists the shortfalls."""
    unproven: list[dict] = field(default_factory=list)
    """The rows :class:`~shared_teacher.errors.CrossNodeSkewError` would have reported."""


def _same_order(config: SourceConfig) -> bool:
    nodes = list(config.nodes)
    if len(nodes) == 1:
        return True
    if any(s.packed for s in config.students):
        return False
    base = config.students[0]
    return all(s.quantum(n) * base.quantum(nodes[0]) == base.quantum(n) * s.quantum(nodes[0])
               for s in config.students for n in nodes)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _skew_pair(c: StudentSpec, b: StudentSpec, node: str, sizes: dict[str, int]) -> int:
    """``skew(c, b, node)`` of the module docstring: a bound on ``x_c − x_b`` on ``node`` over states where
    ``c`` waits on ``node``, both are in one epoch and ``b`` has passed at least as many positions."""
    d, rest = sizes[node], sum(sizes.values()) - sizes[node]
    wb, qb = sum(b.quantum(m) for m in sizes), b.quantum(node)
    if c.packed:
        if b.packed:
            return min(d - 1, rest)
        top = min(d - 1, windows_per_epoch(b, sizes) * wb)
        return max(a - _ceil_div(a, wb) * qb for a in (top, top // wb * wb))
    qc, wc = c.quantum(node), sum(c.quantum(m) for m in sizes)
    kmax = min(windows_per_epoch(c, sizes), d // qc - 1)
    if b.packed:
        k1 = min(kmax, rest // wc)
        return max(k * qc - max(0, k * wc - rest) for k in (0, k1, min(kmax, k1 + 1)))
    kmax = min(kmax, windows_per_epoch(b, sizes) * wb // wc)  # b cannot pass more than K_b windows
    if kmax < 0:
        return 0
    # f(k) = k·q_c − ceil(k·W_c/W_b)·q_b is linear plus a term of period W_b/gcd: its maximum lies in
    # the last period when the slope q_c·W_b − W_c·q_b is ≥ 0, else in the first.
    period = wb // math.gcd(wc, wb)
    ks = (range(max(0, kmax - period + 1), kmax + 1) if qc * wb >= wc * qb else range(min(kmax, period - 1) + 1))
    return max(k * qc - _ceil_div(k * wc, wb) * qb for k in ks)


def cross_node_skew(config: SourceConfig) -> dict[str, dict[str, tuple[int, str]]]:
    """node → student ``c`` → ``(S_cn, b)``: the skew bound of the module docstring and the student ``b``
    it is measured against (``''`` when 0). Assumes the structural checks of :func:`preflight` passed."""
    sizes = node_epoch_sizes(config.dataset_size, list(config.nodes))
    out: dict[str, dict[str, tuple[int, str]]] = {}
    for n in config.nodes:
        out[n] = {}
        for c in config.students:
            best = (0, "")
            for b in config.students:
                if b is not c:
                    k = _skew_pair(c, b, n, sizes)
                    if k > best[0]:
                        best = (k, b.name)
            out[n][c.name] = best
    return out


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
    for s in config.students:
        for n in nodes:
            need(n, s.name, "ranks_on_node", 1, s.ranks_per_node.get(n, 0))
            quanta[n][s.name] = s.quantum(n)
    if bad:
        raise _error(bad)
    for s in config.students:
        if s.packed:
            need("*", s.name, "pack_budget_tokens >= max_seq_len", config.max_seq_len, s.pack_budget_tokens)
            for n in nodes:
                need(n, s.name, "epoch_size*min_seq_len >= quantum_tokens", s.quantum(n),
                     sizes[n] * config.min_seq_len)
        else:
            need("*", s.name, "windows_per_epoch", 1, windows_per_epoch(s, sizes))
    needs: dict[str, dict[str, int]] = {n: {} for n in nodes}
    capacity: dict[str, int] = {}
    for n in nodes:
        lim = config.nodes[n]
        capacity[n] = admission_capacity(lim, max_sample_bytes=config.max_sample_bytes)
        for s in config.students:
            k = need_samples(s, n, min_seq_len=config.min_seq_len, epoch_size=sizes[n])
            needs[n][s.name] = k
            what = "ceil(quantum_tokens/min_seq_len) capped at epoch size" if s.packed else "quantum"
            need(n, s.name, f"high_samples >= {what}", k, lim.high_samples)
            if lim.byte_cap:
                need(n, s.name, f"byte_cap >= ({what})*max_sample_bytes", k * config.max_sample_bytes,
                     lim.byte_cap)
    if bad:
        raise _error(bad)
    skews = cross_node_skew(config)
    short: list[dict] = []
    for n in nodes:
        lim = config.nodes[n]
        for s in config.students:
            k, against = skews[n][s.name]
            if capacity[n] < needs[n][s.name] + k:
                short.append({"node": n, "student": s.name, "check": "capacity >= share + cross_node_skew",
                              "need": needs[n][s.name] + k, "have": capacity[n], "share": needs[n][s.name],
                              "skew": k, "against": against, "high_samples": lim.high_samples,
                              "byte_cap": lim.byte_cap})
    report = PreflightReport(epoch_sizes=sizes, quanta=quanta, needs=needs, capacity=capacity,
                             same_order_on_all_nodes=_same_order(config),
                             skew={n: {c: v[0] for c, v in row.items()} for n, row in skews.items()},
                             proven=not short, unproven=short)
    if short:
        err = _skew_error(short, config.max_sample_bytes)
        if not config.allow_unproven_layout:
            raise err
        warnings.warn(f"allow_unproven_layout=True: starting without a progress proof; the watchdog "
                      f"(watchdog_s={config.watchdog_s}) is the only guard. {err}", RuntimeWarning, stacklevel=2)
    return report


def _error(bad: list[dict]) -> AdmissionConfigError:
    lines = [f"node {b['node']!r} student {b['student']!r}: {b['check']}: need {b['need']}, have {b['have']}"
             for b in bad]
    return AdmissionConfigError("admission preflight failed (progress not guaranteed):\n  " + "\n  ".join(lines), bad)


def _skew_error(short: list[dict], max_sample_bytes: int) -> CrossNodeSkewError:
    lines = [f"node {b['node']!r} student {b['student']!r}: capacity {b['have']} (high_samples={b['high_samples']}, "
             f"byte_cap={b['byte_cap']}) < share {b['share']} + cross-node skew {b['skew']} against "
             f"{b['against']!r} = {b['need']}" for b in short]
    fix = {}
    for b in short:
        fix[b["node"]] = max(fix.get(b["node"], 0), b["need"])
    todo = "; ".join(f"node {n!r}: high_samples >= {k}" + (f" and byte_cap >= {k * max_sample_bytes}"
                     if any(b["byte_cap"] and b["node"] == n for b in short) else "") for n, k in fix.items())
    return CrossNodeSkewError(
        "admission preflight cannot prove progress: students drift apart differently on different nodes "
        "(uneven rank splits or packed students across nodes) and a node's caps may fill with samples the "
        "trailing student does not need yet:\n  " + "\n  ".join(lines) +
        f"\nfix: raise {todo}; or give every student the same per-node rank proportions (skew 0); or set "
        "SourceConfig.allow_unproven_layout=True to start with the watchdog as the only guard.", short)


class NodeGate:
    """Runtime admission state of one node (the rules the preflight and the simulator assume).

    The owner calls :meth:`release_starved` whenever the student at the node's oldest position
    cannot start its next share (rule 3 of the module docstring).
    """

    def __init__(self, limits: NodeLimits, *, max_sample_bytes: int) -> None:
        self.limits = limits
        self.max_sample_bytes = max_sample_bytes
        self.samples = 0
        self.tokens = 0
        self.bytes = 0
        self.paused_samples = False
        self.paused_tokens = False
        self.starvation_releases = 0

    @property
    def at_hard_cap(self) -> bool:
        lim = self.limits
        return self.samples >= lim.high_samples or (
            bool(lim.byte_cap) and self.bytes + self.max_sample_bytes > lim.byte_cap)

    @property
    def latched(self) -> bool:
        return self.paused_samples or self.paused_tokens

    def can_admit(self) -> bool:
        return not (self.latched or self.at_hard_cap)

    def release_starved(self) -> None:
        """Clear the hysteresis latches (the oldest student cannot start; hard caps still apply)."""
        if self.latched:
            self.paused_samples = self.paused_tokens = False
            self.starvation_releases += 1

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
        """Replace the reservation of one sample by its stored size (at most ``max_sample_bytes``,
        which admission reserved: a larger object would break the byte cap)."""
        if not 0 <= nbytes <= self.max_sample_bytes:
            raise PublishError(f"object of {nbytes} bytes exceeds max_sample_bytes={self.max_sample_bytes} "
                               "reserved at admission")
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
                "at_hard_cap": self.at_hard_cap, "starvation_releases": self.starvation_releases}
