"""Routing: validation, stamping, required teachers, routed scoring with real models, aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_distill.testing import assert_close
from mopd import reference as ref
from mopd.backends import TransformersTeacher
from mopd.config import ROUTE_KEY, RoutingSpec, TeacherPoolConfig
from mopd.errors import ConfigError, NonFiniteInputError, RouteMutationError, RoutingError
from mopd.routing import (
    TargetAccumulator,
    derive,
    required_teachers,
    score_routed,
    stamp_routes,
    teacher_assignments,
    verify_routes,
)
from mopd.teachers import TeacherPool, TeacherState
from tests.mopd.mopd_helpers import reference_logp, tiny_qwen3, token_batch

SPEC = RoutingSpec(field="task_type", routes={"math": {"m": 1.0}, "code": {"c": 2.0},
                                              "mix": {"m": 0.5, "c": 0.25, "unused": 0.0}, "3": {"g": 1.0}})


@pytest.mark.parametrize("kwargs,match", [
    ({"routes": []}, "must be a mapping"),
    ({"routes": {"a": {"t": -1.0}}}, r"routes\['a'\]\['t'\] must be >= 0"),
    ({"routes": {"a": {"t": math.nan}}}, "finite"),
    ({"routes": {"a": {"t": 0.0}}}, "no positive weight"),
    ({"routes": {"a": {"actor": 1.0}}}, "reserved"),
    ({"routes": {"a": {"../etc": 1.0}}}, "not file-safe"),
    ({"routes": {"a": {"t": True}}}, "finite number"),
    ({"routes": {"a": {"t": 1.0}}, "default_route": "b", "strict": False}, "default_route"),
    ({"routes": {"a": {"t": 1.0}}, "field": "mopd_route"}, "reserved key"),
])
def test_spec_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RoutingSpec(**kwargs)


def test_unknown_teacher_ids_rejected():
    with pytest.raises(ConfigError, match=r"unknown teachers \['g'\]"):
        SPEC.check_teachers(["m", "c", "unused"])


def test_stamp_derive_verify():
    samples = [{"task_type": "math"}, {"task_type": "code"}, {"task_type": 3}]
    assert stamp_routes(samples, SPEC) == ["math", "code", "3"]
    trajs = [derive(samples[i], {"task_type": samples[i]["task_type"], "turn": k}) for i in range(3) for k in range(2)]
    assert verify_routes(trajs, SPEC) == ["math", "math", "code", "code", "3", "3"]
    trajs[2]["task_type"] = "math"  # a workflow edits the routing field
    with pytest.raises(RouteMutationError, match="trajectory 2.*workflows may not change the route"):
        verify_routes(trajs, SPEC)
    with pytest.raises(RouteMutationError, match="derived trajectory carries"):
        derive(samples[0], {ROUTE_KEY: "code"})
    with pytest.raises(RoutingError, match="no 'mopd_route' stamp"):
        verify_routes([{"task_type": "math"}], SPEC)


def test_bad_samples_leave_batch_untouched():
    samples = [{"task_type": "math"}, {"task_type": True}]
    with pytest.raises(RoutingError, match="sample 1: routing field 'task_type' must be str or int, got bool"):
        stamp_routes(samples, SPEC)
    assert ROUTE_KEY not in samples[0]
    with pytest.raises(RoutingError, match="sample 0 has no routing field 'task_type'"):
        stamp_routes([{"other": 1}], SPEC)
    with pytest.raises(RoutingError, match="'poetry' names no route"):
        stamp_routes([{"task_type": "poetry"}], SPEC)
    lenient = RoutingSpec(routes={"a": {"t": 1.0}}, default_route="a", strict=False)
    assert stamp_routes([{}, {"task_type": "zzz"}], lenient) == ["a", "a"]


def test_required_teachers_and_assignments():
    assert required_teachers(["math", "math"], SPEC) == ["m"]
    assert required_teachers(["mix"], SPEC) == ["c", "m"]  # zero-weight 'unused' never required
    routes = ["code", "math", "mix", "code"]
    a = teacher_assignments(routes, SPEC, dtype=torch.float64)
    assert set(a) == {"c", "m"}
    assert a["c"].indices.tolist() == [0, 2, 3] and a["c"].weights.tolist() == [2.0, 0.25, 2.0]
    assert a["m"].indices.tolist() == [1, 2] and a["m"].weights.tolist() == [1.0, 0.5]
    with pytest.raises(RoutingError, match="unknown routes"):
        required_teachers(["nope"], SPEC)


def test_accumulator_matches_dense_reference_and_rejects_nan():
    g = torch.Generator().manual_seed(0)
    K, B, L = 3, 5, 7
    logp = -3 * torch.rand(K, B, L, dtype=torch.float64, generator=g)
    w = torch.rand(K, B, dtype=torch.float64, generator=g) * (torch.rand(K, B, generator=g) > 0.4)
    w[0] += 0.2
    valid = torch.ones(B, L, dtype=torch.bool)
    acc = TargetAccumulator(valid, dtype=torch.float64)
    for j in range(K):
        idx = (w[j] > 0).nonzero()[:, 0]
        acc.add(f"t{j}", idx, w[j, idx], logp[j, idx])
    s, wsum, lse = ref.aggregate_reference(logp, w)
    t = acc.targets()
    assert_close("S", s, t.logp_sum, atol=1e-12, rtol=1e-12)
    assert_close("W", wsum, t.weight_sum, atol=1e-12, rtol=1e-12)
    assert_close("L", lse, t.mix_lse, atol=1e-12, rtol=1e-12)
    bad = logp[0].clone()
    bad[2, 4] = math.nan
    acc2 = TargetAccumulator(valid, dtype=torch.float64)
    with pytest.raises(NonFiniteInputError, match="teacher 'x' returned non-finite log-prob nan for batch sample 2 "
                                                  "at position 4"):
        acc2.add("x", torch.arange(B), torch.ones(B, dtype=torch.float64), bad)
    assert acc2.weight_sum.abs().sum() == 0 and not acc2.teacher_stats  # nothing half-updated


def test_score_routed_scores_each_sample_by_exactly_its_teachers():
    models = {tid: tiny_qwen3(seed) for tid, seed in (("m", 1), ("c", 2), ("g", 3), ("unused", 4))}
    events = []
    backends = {tid: TransformersTeacher(tid, (lambda mm=mm: mm), temperature=0.8) for tid, mm in models.items()}
    pool = TeacherPool(backends, config=TeacherPoolConfig(), on_event=lambda t, e: events.append((t, e)))
    batch = token_batch(6, 9, seed=1, score_from=True)
    routes = ["math", "code", "mix", "math", "mix", "code"]
    old = -2 * torch.rand(6, 9, dtype=torch.float64)
    targets, stats = score_routed(pool, batch, routes, SPEC, old_logp=old, dtype=torch.float64)
    # unused teachers are never loaded, not even prefetched
    assert pool.state("g") is TeacherState.EMPTY and pool.state("unused") is TeacherState.EMPTY
    assert not any(t in ("g", "unused") for t, _ in events)
    assert {t for t, e in events if e == "load"} == {"c", "m"}
    # expected targets from per-row references of exactly the routed teachers
    lp = {tid: reference_logp(models[tid], batch, 0.8) for tid in ("m", "c")}
    s = torch.zeros(6, 9, dtype=torch.float64)
    w = torch.zeros(6, 9, dtype=torch.float64)
    mask = batch.label_mask()
    for b, r in enumerate(routes):
        for tid, wt in SPEC.routes[r].items():
            if wt > 0:
                s[b] += wt * lp[tid][b]
                w[b] += wt * mask[b]
    assert_close("S", s, targets.logp_sum, atol=1e-5, rtol=1e-5)
    assert_close("W", w, targets.weight_sum, atol=0, rtol=0)
    assert stats["m"]["samples"] == 4 and stats["c"]["samples"] == 4
    assert stats["m"]["tokens"] == float(mask[[0, 2, 3, 4]].sum())
    # a second batch that needs only 'c' reuses the resident teacher, no reload
    events.clear()
    score_routed(pool, batch, ["code"] * 6, SPEC)
    assert ("c", "load") not in events and ("m", "load") not in events
    pool.close()
    pool.close()  # idempotent
    assert set(pool.states().values()) == {TeacherState.CLOSED}


@pytest.mark.parametrize("value", [math.nan, -math.inf], ids=["nan", "-inf"])
def test_in_process_teacher_nonfinite_score_is_a_sample_error_not_a_broken_teacher(value):
    """An in-process teacher's NaN/−inf at an active token: score_routed raises NonFiniteInputError
    naming teacher, sample and position; the lease ends, the teacher stays RESIDENT and scores the
    next batch."""
    model = tiny_qwen3(5)
    poison = {"on": True}

    class Poisoned(TransformersTeacher):
        def score(self, batch):
            out = super().score(batch)
            if poison["on"]:
                out[0, 3] = value  # row 0 has full length: an active label
            return out

    pool = TeacherPool({"m": Poisoned("m", lambda: model)}, config=TeacherPoolConfig(wait_timeout_s=2.0))
    batch = token_batch(3, 8, seed=2)
    spec = RoutingSpec(routes={"math": {"m": 1.0}})
    with pytest.raises(NonFiniteInputError, match=f"teacher 'm' returned non-finite log-prob {value!r} for batch "
                                                  "sample 0 at position 3"):
        score_routed(pool, batch, ["math"] * 3, spec)
    assert pool.state("m") is TeacherState.RESIDENT
    poison["on"] = False
    targets, _ = score_routed(pool, batch, ["math"] * 3, spec)  # the lease was ended: no timeout
    assert torch.isfinite(targets.logp_sum).all()
    pool.close()
