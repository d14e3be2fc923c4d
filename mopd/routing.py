"""Routing samples to teachers, and aggregating routed teacher scores into per-token targets.

A route is resolved once per prompt sample from ``spec.field`` and stamped under the reserved
key ``mopd_route``; every trajectory derived from that sample carries the same stamp
(:func:`derive`), and :func:`verify_routes` rejects a trajectory whose stamp was changed by a
workflow. :func:`required_teachers` lists only teachers with positive weight in a route present
in the batch (the others are never loaded); :func:`teacher_assignments` gives each of them
exactly its routed samples. :class:`TargetAccumulator` folds each teacher's scores into three
``[B, L]`` buffers, S = Σ w ℓ, W = Σ w and L = log Σ w e^ℓ, so memory and the loss cost do
not depend on the number of teachers, and each teacher costs O(its routed tokens).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from mopd.backends import TokenBatch
from mopd.config import ROUTE_KEY, RoutingSpec
from mopd.errors import NonFiniteInputError, RouteMutationError, RoutingError
from mopd.objectives import TokenTargets
from mopd.teachers import TeacherPool

__all__ = [
    "Assignment",
    "TargetAccumulator",
    "derive",
    "required_teachers",
    "resolve_route",
    "score_routed",
    "stamp_routes",
    "teacher_assignments",
    "verify_routes",
]


def resolve_route(sample: Mapping, spec: RoutingSpec, *, index: int | None = None) -> str:
    """The route of one sample from ``sample[spec.field]``.

    ``str`` values name a route; ``int`` values name the route spelled by their decimal string;
    ``bool`` and other types raise. A missing field or unknown route raises
    :class:`RoutingError` when ``spec.strict``, else falls back to ``spec.default_route``.
    """
    where = f"sample {index}" if index is not None else "sample"
    if spec.field not in sample:
        if spec.strict or spec.default_route is None:
            raise RoutingError(f"{where} has no routing field {spec.field!r} (keys: {sorted(map(str, sample))})")
        return spec.default_route
    value = sample[spec.field]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RoutingError(f"{where}: routing field {spec.field!r} must be str or int, got "
                           f"{type(value).__name__} {value!r}")
    route = str(value)
    if route not in spec.routes:
        if spec.strict or spec.default_route is None:
            raise RoutingError(f"{where}: {spec.field}={value!r} names no route; routes: {sorted(spec.routes)}")
        return spec.default_route
    return route


def stamp_routes(samples: Sequence[MutableMapping], spec: RoutingSpec) -> list[str]:
    """Resolve and stamp ``sample['mopd_route']`` on every sample; return the routes.

    All routes are resolved before any sample is written, so a bad sample leaves the batch
    untouched. A sample already stamped with a different route raises :class:`RouteMutationError`.
    """
    routes = [resolve_route(s, spec, index=i) for i, s in enumerate(samples)]
    for i, (s, r) in enumerate(zip(samples, routes)):
        if ROUTE_KEY in s and s[ROUTE_KEY] != r:
            raise RouteMutationError(f"sample {i} is already stamped {ROUTE_KEY}={s[ROUTE_KEY]!r}, resolved {r!r}")
    for s, r in zip(samples, routes):
        s[ROUTE_KEY] = r
    return routes


def derive(parent: Mapping, child: MutableMapping) -> MutableMapping:
    """Copy the parent's route stamp (and routing field) onto a derived trajectory.

    Raises :class:`RouteMutationError` if the child already carries a different stamp, and
    :class:`RoutingError` if the parent was never stamped.
    """
    if ROUTE_KEY not in parent:
        raise RoutingError(f"parent sample has no {ROUTE_KEY!r} stamp: call stamp_routes first")
    route = parent[ROUTE_KEY]
    if ROUTE_KEY in child and child[ROUTE_KEY] != route:
        raise RouteMutationError(f"derived trajectory carries {ROUTE_KEY}={child[ROUTE_KEY]!r}, parent has {route!r}")
    child[ROUTE_KEY] = route
    return child


def verify_routes(trajectories: Sequence[Mapping], spec: RoutingSpec) -> list[str]:
    """Check every trajectory is stamped with a known route equal to what its routing field
    resolves to (a workflow that edited either is rejected); return the routes."""
    routes = []
    for i, t in enumerate(trajectories):
        if ROUTE_KEY not in t:
            raise RoutingError(f"trajectory {i} has no {ROUTE_KEY!r} stamp (derive it from its sample)")
        stamped = t[ROUTE_KEY]
        if stamped not in spec.routes:
            raise RoutingError(f"trajectory {i}: stamped route {stamped!r} is not a route ({sorted(spec.routes)})")
        if spec.field in t and resolve_route(t, spec, index=i) != stamped:
            raise RouteMutationError(
                f"trajectory {i}: {spec.field}={t[spec.field]!r} resolves to {resolve_route(t, spec, index=i)!r} "
                f"but the sample was stamped {stamped!r}; workflows may not change the route")
        routes.append(stamped)
    return routes


def required_teachers(routes: Iterable[str], spec: RoutingSpec) -> list[str]:
    """Teachers with a positive weight in a route present in ``routes``, sorted."""
    present = set(routes)
    unknown = present - set(spec.routes)
    if unknown:
        raise RoutingError(f"unknown routes {sorted(unknown)}; routes: {sorted(spec.routes)}")
    return sorted({t for r in present for t, w in spec.routes[r].items() if w > 0})


@dataclass(frozen=True, slots=True)
class Assignment:
    """Samples routed to one teacher: batch ``indices [n]`` (int64) and their ``weights [n]``."""

    teacher_id: str
    indices: torch.Tensor
    weights: torch.Tensor


def teacher_assignments(routes: Sequence[str], spec: RoutingSpec, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> dict[str, Assignment]:
    """Per required teacher, the samples it must score (positive weight only), in batch order."""
    out: dict[str, Assignment] = {}
    for tid in required_teachers(routes, spec):
        idx = [i for i, r in enumerate(routes) if spec.routes[r].get(tid, 0.0) > 0]
        w = [spec.routes[routes[i]][tid] for i in idx]
        out[tid] = Assignment(tid, torch.tensor(idx, dtype=torch.long, device=device),
                              torch.tensor(w, dtype=dtype, device=device))
    return out


class TargetAccumulator:
    """Folds per-teacher token log-probs into :class:`~mopd.objectives.TokenTargets`.

    Buffers are ``[B, L]``: S = Σ_j w_j ℓ_j, W = Σ_j w_j, L = log Σ_j w_j e^{ℓ_j} (−inf where
    no teacher). ``valid [B, L]`` marks positions whose teacher scores are meaningful (others
    are ignored, NaN included). Optional ``old_logp [B, L]`` and ``loss_mask [B, L]`` enable
    per-teacher metrics against the behaviour policy.
    """

    def __init__(self, valid: torch.Tensor, *, dtype: torch.dtype = torch.float32, old_logp: torch.Tensor | None = None,
                 loss_mask: torch.Tensor | None = None) -> None:
        if valid.dim() != 2:
            raise ValueError(f"valid must be [B, L], got shape {tuple(valid.shape)}")
        self.valid = valid.bool()
        self.logp_sum = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
        self.weight_sum = torch.zeros_like(self.logp_sum)
        self.mix_lse = torch.full_like(self.logp_sum, -math.inf)
        self.old_logp = old_logp
        self.loss_mask = self.valid if loss_mask is None else (loss_mask.bool() & self.valid)
        self._stats: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, teacher_id: str, indices: torch.Tensor, weights: torch.Tensor, logp: torch.Tensor) -> None:
        """Add teacher ``teacher_id``'s scores ``logp [n, L]`` of samples ``indices [n]`` with
        ``weights [n]`` (> 0). Validates everything before touching the buffers."""
        n, L = indices.shape[0], self.valid.shape[1]
        if logp.shape != (n, L):
            raise ValueError(f"teacher {teacher_id!r}: logp shape {tuple(logp.shape)} != (n={n}, L={L})")
        if teacher_id in self._stats:
            raise ValueError(f"teacher {teacher_id!r} was already added to this accumulator")
        valid = self.valid[indices]
        bad = valid & ~torch.isfinite(logp)
        bad_w = (weights <= 0) | ~torch.isfinite(weights)
        if bool(bad.any() | bad_w.any()):  # the only host sync of add()
            if bool(bad_w.any()):
                raise ValueError(f"teacher {teacher_id!r}: weights must be finite and > 0, got {weights.tolist()}")
            r, c = bad.nonzero()[0].tolist()
            raise NonFiniteInputError(
                f"teacher {teacher_id!r} returned non-finite log-prob {logp[r, c].item()!r} for batch sample "
                f"{int(indices[r])} at position {c} ({int(bad.sum())} such positions)")
        lp = torch.where(valid, logp.to(self.logp_sum.dtype), torch.zeros_like(self.logp_sum[:1]))
        w = weights.to(lp.dtype)[:, None].expand_as(lp)
        w = torch.where(valid, w, torch.zeros_like(w))
        self.logp_sum.index_add_(0, indices, w * lp)
        self.weight_sum.index_add_(0, indices, w)
        term = torch.where(valid, lp + torch.log(w.clamp(min=torch.finfo(lp.dtype).tiny)),
                           torch.full_like(lp, -math.inf))
        self.mix_lse[indices] = torch.logaddexp(self.mix_lse[indices], term)
        m = self.loss_mask[indices]
        stats = {"samples": torch.tensor(float(n)), "tokens": m.sum(), "weight_sum": (w * m).sum(),
                 "logp_sum": (lp * m).sum()}
        if self.old_logp is not None:
            old = torch.where(m, self.old_logp[indices].to(lp.dtype), torch.zeros_like(lp))
            stats["reward_vs_behaviour_sum"] = (w * (lp - old) * m).sum()
        self._stats[teacher_id] = stats

    @property
    def teacher_stats(self) -> dict[str, dict[str, float]]:
        """Per teacher: ``samples``, ``tokens`` (in ``loss_mask``), ``weight_sum``, ``logp_sum``
        and, with ``old_logp``, ``reward_vs_behaviour_sum`` = Σ w (ℓ_j − ℓ_old). Reading it syncs."""
        return {t: {k: float(v) for k, v in st.items()} for t, st in self._stats.items()}

    def targets(self) -> TokenTargets:
        """The aggregated targets (detached ``[B, L]`` tensors)."""
        return TokenTargets(logp_sum=self.logp_sum, weight_sum=self.weight_sum, mix_lse=self.mix_lse)


def _score_order(pool: TeacherPool, teachers: list[str]) -> list[str]:
    """The resident teacher first (reuse, no swap), then the others sorted."""
    resident = pool.resident()
    return ([resident] if resident in teachers else []) + [t for t in teachers if t != resident]


def score_routed(pool: TeacherPool, batch: TokenBatch, routes: Sequence[str], spec: RoutingSpec, *,
                 old_logp: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[TokenTargets, dict[str, dict[str, float]]]:
    """Score ``batch`` with exactly the teachers its routes need, each on its routed rows only.

    Teachers are acquired one at a time (the next one prefetched), their outputs folded into a
    :class:`TargetAccumulator` and drained before release. Returns the ``[B, L]`` targets and
    per-teacher stats (``samples``, ``tokens``, ``weight_sum``, ``logp_sum`` and, with
    ``old_logp``, ``reward_vs_behaviour_sum`` = Σ w (ℓ_j − ℓ_old) over ``loss_mask``).
    """
    if len(routes) != batch.input_ids.shape[0]:
        raise ValueError(f"{len(routes)} routes for a batch of {batch.input_ids.shape[0]} rows")
    assignments = teacher_assignments(routes, spec, dtype=dtype, device=batch.input_ids.device)
    acc = TargetAccumulator(batch.label_mask(), dtype=dtype, old_logp=old_logp, loss_mask=loss_mask)
    order = _score_order(pool, list(assignments))
    width = batch.input_ids.shape[1]
    for i, tid in enumerate(order):
        a = assignments[tid]
        with pool.acquire(tid, prefetch_next=order[i + 1] if i + 1 < len(order) else None) as lease:
            logp = lease.score(batch.subset(a.indices)).take()
            acc.add(tid, a.indices, a.weights, torch.nn.functional.pad(logp, (0, width - logp.shape[1])))
            del logp  # the drain receipt checks that no reference survives
    return acc.targets(), acc.teacher_stats
