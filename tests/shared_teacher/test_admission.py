"""Preflight vs the exhaustive simulator, named errors with numbers, config validation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from shared_teacher import (
    CompatKey,
    NodeLimits,
    SharedTeacherSource,
    ShmStore,
    SourceConfig,
    SourceConfigError,
    StudentSpec,
    preflight,
)
from shared_teacher.admission import node_epoch_sizes
from shared_teacher.errors import AdmissionConfigError, CrossNodeSkewError, StateBudgetExceeded
from shared_teacher.reference import SimNode, SimStudent, simulate_node, simulate_nodes

# The property tests enumerate every interleaving; a few random configs have huge state spaces.
# Those examples are rejected (``assume``) instead of running for minutes: the bound keeps each
# example well under a second and CI time predictable.
SIM_MAX_STATES = 20_000


def _bounded(sim, **kw):
    try:
        return sim(**kw, max_states=SIM_MAX_STATES)
    except StateBudgetExceeded:
        event("rejected: state space over the budget")
        assume(False)


KEY = CompatKey(teacher_fingerprint="t", tokenizer="tok", signals=["logprobs"], max_length=64)


def _cfg(*, high, low, students, d=64, cap=0, nodes=("n0",), high_tokens=0, low_tokens=0, max_seq_len=16,
         min_seq_len=1, max_bytes=100):
    return SourceConfig(key=KEY, dataset_size=d, max_sample_bytes=max_bytes, max_seq_len=max_seq_len,
                        min_seq_len=min_seq_len, students=students,
                        nodes={n: NodeLimits(high_samples=high, low_samples=low, high_tokens=high_tokens,
                                             low_tokens=low_tokens, byte_cap=cap) for n in nodes})


def test_watermark_below_quantum_is_refused_with_numbers():
    """ASpec review case: 4 ranks × micro-batch 2 on a node need 8 ready samples; H = 6 deadlocks."""
    s = StudentSpec(name="draft", ranks_per_node={"n0": 4}, micro_batch_size=2)
    with pytest.raises(AdmissionConfigError) as info:
        preflight(_cfg(high=6, low=6, students=[s]))
    assert "node 'n0' student 'draft': high_samples >= quantum: need 8, have 6" in str(info.value)
    assert info.value.details[0] == {"node": "n0", "student": "draft", "check": "high_samples >= quantum",
                                     "need": 8, "have": 6}
    res = simulate_node(students=[SimStudent(quantum=8)], epoch_size=64, high=6, low=6)
    assert res.stall and res.witness[:2] == ((6,), ((0,),))


def test_hysteresis_remainder_stalls_a_plain_latch_but_not_ours():
    """H = 250, Q = 64: after three windows 58 remain. A plain latch with L < 58 waits forever (the
    ASpec finding); the starvation release reopens admission, so preflight accepts any L."""
    s = StudentSpec(name="draft", ranks_per_node={"n0": 8}, micro_batch_size=8)
    q = [SimStudent(quantum=64)]
    for low in (0, 57):
        plain = simulate_node(students=q, epoch_size=640, high=250, low=low, starvation_release=False)
        assert plain.stall and plain.witness[0][0] - plain.witness[1][0][0] == 58, plain.witness[:2]
        assert not simulate_node(students=q, epoch_size=640, high=250, low=low).stall
        preflight(_cfg(high=250, low=low, students=[s], d=640))
    assert not simulate_node(students=q, epoch_size=640, high=250, low=58, starvation_release=False).stall


def _spec(i, kind, ranks, acc, size):
    if kind == "packed":
        return StudentSpec(name=f"p{i}", ranks_per_node={"n0": ranks}, accumulation_steps=acc, packed=True,
                           pack_budget_tokens=size)
    return StudentSpec(name=f"u{i}", ranks_per_node={"n0": ranks}, accumulation_steps=acc, micro_batch_size=size)


@st.composite
def mixed_node_configs(draw):
    """One node: 1-3 students, unpacked (Q ≤ D) or packed (budget ≥ max_seq_len, T ≤ D·s), lengths in [s, m],
    sample/token watermarks, a byte cap with a remainder below one object, any lag cap."""
    s = draw(st.integers(1, 3))
    m = draw(st.integers(s, s + 1))
    d = draw(st.integers(2, 12))
    students = []
    for i in range(draw(st.integers(1, 3))):
        ranks, acc = draw(st.integers(1, 2)), draw(st.integers(1, 2))
        if draw(st.booleans()):
            budget = draw(st.integers(m, m + 2))
            if ranks * acc * budget > d * s:  # keep D·s ≥ T (structural check): one bin of max_seq_len
                ranks, acc, budget = 1, 1, m
            students.append(_spec(i, "packed", ranks, acc, budget))
        else:
            if ranks * acc > d:
                ranks = acc = 1
            students.append(_spec(i, "unpacked", ranks, acc, draw(st.integers(1, d // (ranks * acc)))))
    high = draw(st.integers(1, 9))
    low = draw(st.integers(0, high))
    high_tokens = draw(st.sampled_from([0, draw(st.integers(1, 12))]))
    low_tokens = draw(st.integers(0, high_tokens))
    cap = draw(st.sampled_from([0, draw(st.integers(1, 10)) * 10 + draw(st.integers(0, 9))]))  # max_sample_bytes=10
    lag = draw(st.sampled_from([0, 1, 3, 1 << 30]))
    return dict(s=s, m=m, d=d, students=students, high=high, low=low, high_tokens=high_tokens,
                low_tokens=low_tokens, cap=cap, lag=lag)


def _preflight_accepts(c) -> bool:
    cfg = SourceConfig(key=KEY, dataset_size=c["d"], max_sample_bytes=10, max_seq_len=c["m"], min_seq_len=c["s"],
                       students=c["students"], lag_cap_samples=c["lag"],
                       nodes={"n0": NodeLimits(high_samples=c["high"], low_samples=c["low"],
                                               high_tokens=c["high_tokens"], low_tokens=c["low_tokens"],
                                               byte_cap=c["cap"])})
    try:
        preflight(cfg)
        return True
    except AdmissionConfigError:
        return False


def _simulate(c):
    sims = [SimStudent(quantum=x.quantum("n0"), pack_budget=x.pack_budget_tokens if x.packed else 0,
                       bins=x.ranks_per_node["n0"] * x.accumulation_steps) for x in c["students"]]
    lengths_matter = c["high_tokens"] or any(x.packed for x in c["students"])
    return _bounded(simulate_node, students=sims, epoch_size=c["d"], high=c["high"], low=c["low"],
                         high_tokens=c["high_tokens"], low_tokens=c["low_tokens"], byte_cap_samples=c["cap"] // 10,
                         lengths=tuple(range(c["s"], c["m"] + 1)) if lengths_matter else (1,), lag_cap=c["lag"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_node_configs())
def test_preflight_accepts_exactly_the_configs_that_never_stall(case):
    """Mixed students on a node: preflight accepts ⇔ no interleaving and no length sequence stalls."""
    res = _simulate(case)
    event("stall" if res.stall else "progress")
    event("packed" if any(x.packed for x in case["students"]) else "unpacked only")
    assert _preflight_accepts(case) == (not res.stall), (case, res)


def test_equivalence_cases_on_both_sides():
    """Fixed cases at the boundary, both outcomes (so the property test is not vacuous)."""
    packed = _spec(0, "packed", 1, 2, 3)  # T = 6 tokens, lengths in [2, 3] → need min(ceil(6/2), D) = 3
    unpacked = _spec(1, "unpacked", 1, 1, 2)  # Q = 2
    base = dict(s=2, m=3, d=8, students=[packed, unpacked], low=0, high_tokens=4, low_tokens=0, lag=0)
    for high, cap, ok in [(3, 0, True), (2, 0, False), (9, 39, True), (9, 29, False)]:
        c = dict(base, high=high, cap=cap)
        assert _preflight_accepts(c) is ok and _simulate(c).stall is (not ok), c
    # a token latch far below T never stalls (it yields to the starving packed student)
    assert _preflight_accepts(dict(base, high=3, cap=0, high_tokens=1)) and not _simulate(
        dict(base, high=3, cap=0, high_tokens=1)).stall
    # an epoch that may hold fewer than T tokens is refused as a structural error (partial or dropped windows)
    c = dict(base, d=2, students=[packed], high=2, cap=0)
    with pytest.raises(AdmissionConfigError, match="epoch_size\\*min_seq_len >= quantum_tokens: need 6, have 4"):
        preflight(SourceConfig(key=KEY, dataset_size=2, max_sample_bytes=10, max_seq_len=3, min_seq_len=2,
                               students=[packed], nodes={"n0": NodeLimits(high_samples=2, low_samples=0)}))


STRUCTURAL = {"ranks_on_node", "windows_per_epoch", "pack_budget_tokens >= max_seq_len",
              "epoch_size*min_seq_len >= quantum_tokens"}


@st.composite
def two_node_configs(draw, *, same_order: bool):
    """Two nodes, 1-2 students. ``same_order``: unpacked with per-node quanta proportional across
    nodes (``ranks_cn = g_c·h_n``); otherwise any rank split, packed or unpacked."""
    s = draw(st.integers(1, 2))
    m = draw(st.integers(s, s + 1)) if same_order else s
    d = draw(st.integers(2, 10 if same_order else 8))
    sizes = node_epoch_sizes(d, ["n0", "n1"])
    h = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    students = []
    for i in range(draw(st.integers(1, 2))):
        acc = draw(st.integers(1, 2))
        if same_order:
            g = draw(st.integers(1, 2))
            ranks = {"n0": h[0] * g, "n1": h[1] * g}
        else:
            ranks = {"n0": draw(st.integers(1, 3)), "n1": draw(st.integers(1, 3))}
        if not same_order and draw(st.booleans()):
            students.append(StudentSpec(name=f"p{i}", ranks_per_node=ranks, accumulation_steps=acc, packed=True,
                                        pack_budget_tokens=draw(st.integers(m, m + 2))))
        else:
            most = max(1, min(sizes[n] // (ranks[n] * acc) for n in ranks))
            students.append(StudentSpec(name=f"u{i}", ranks_per_node=ranks, accumulation_steps=acc,
                                        micro_batch_size=draw(st.integers(1, most))))
    nodes = {}
    for n in ("n0", "n1"):
        high = draw(st.integers(1, 6 if same_order else 4))
        cap = draw(st.sampled_from([0, draw(st.integers(1, 7)) * 10 + draw(st.integers(0, 9))]))
        nodes[n] = NodeLimits(high_samples=high, low_samples=draw(st.integers(0, high)), byte_cap=cap)
    return SourceConfig(key=KEY, dataset_size=d, max_sample_bytes=10, max_seq_len=m, min_seq_len=s, students=students,
                        lag_cap_samples=draw(st.sampled_from([0, 2, 1 << 30])), nodes=nodes)


def _preflight_or_none(cfg):
    """The report, None if refused for progress; the example is skipped if refused for structure."""
    try:
        return preflight(cfg)
    except AdmissionConfigError as e:
        assume(not any(d["check"] in STRUCTURAL for d in e.details))
        return None


def _simulate_config(cfg):
    sizes = node_epoch_sizes(cfg.dataset_size, list(cfg.nodes))
    nodes = [SimNode(epoch_size=sizes[n], high=lim.high_samples, low=lim.low_samples, high_tokens=lim.high_tokens,
                     low_tokens=lim.low_tokens, byte_cap_samples=lim.byte_cap // cfg.max_sample_bytes)
             for n, lim in cfg.nodes.items()]
    students = [tuple(SimStudent(quantum=x.quantum(n), pack_budget=x.pack_budget_tokens if x.packed else 0,
                                 bins=x.ranks_per_node[n] * x.accumulation_steps) for n in cfg.nodes)
                for x in cfg.students]
    lengths_matter = any(x.packed for x in cfg.students) or any(lim.high_tokens for lim in cfg.nodes.values())
    return _bounded(simulate_nodes, students=students, nodes=nodes, lag_cap=cfg.lag_cap_samples,
                          lengths=tuple(range(cfg.min_seq_len, cfg.max_seq_len + 1)) if lengths_matter else (1,))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(two_node_configs(same_order=True))
def test_two_nodes_same_order_preflight_is_exact(cfg):
    """Every node orders the students the same way: preflight accepts ⇔ the two-node simulator never stalls."""
    report = _preflight_or_none(cfg)
    res = _simulate_config(cfg)
    event("stall" if res.stall else "progress")
    assert (report is not None) == (not res.stall), (cfg, res)
    if report is not None:
        assert report.same_order_on_all_nodes and report.proven
        assert all(v == 0 for row in report.skew.values() for v in row.values()), report.skew


@st.composite
def any_layout_configs(draw):
    """2 nodes (or 3, smaller), 1-2 students with any rank split per node, packed or unpacked, sample
    watermarks, byte caps with a remainder below one object, any lag cap (kept small enough to enumerate)."""
    names = [f"n{i}" for i in range(draw(st.sampled_from([2, 2, 3])))]
    s = draw(st.integers(1, 2))
    m = s if len(names) == 3 else draw(st.integers(s, s + 1))
    d = draw(st.integers(len(names), 8 if len(names) == 2 else 6))
    sizes = node_epoch_sizes(d, names)
    students = []
    for i in range(draw(st.integers(1, 2))):
        acc = draw(st.integers(1, 2))
        ranks = {n: draw(st.integers(1, 3)) for n in names}
        if draw(st.booleans()):
            budget = draw(st.integers(m, m + 2))
            if any(ranks[n] * acc * budget > sizes[n] * s for n in names):  # keep D_n·s ≥ T (structural)
                acc, budget = 1, m
                ranks = {n: max(1, min(ranks[n], sizes[n] * s // m)) for n in names}
            students.append(StudentSpec(name=f"p{i}", ranks_per_node=ranks, accumulation_steps=acc, packed=True,
                                        pack_budget_tokens=budget))
        else:
            if any(ranks[n] * acc > sizes[n] for n in names):  # keep one window per epoch (structural)
                acc, ranks = 1, {n: min(ranks[n], sizes[n]) for n in names}
            most = max(1, min(sizes[n] // (ranks[n] * acc) for n in ranks))
            students.append(StudentSpec(name=f"u{i}", ranks_per_node=ranks, accumulation_steps=acc,
                                        micro_batch_size=draw(st.integers(1, most))))
    nodes = {}
    for n in names:
        high = draw(st.integers(1, 8))
        cap = draw(st.sampled_from([0, draw(st.integers(1, 8)) * 10 + draw(st.integers(0, 9))]))
        nodes[n] = NodeLimits(high_samples=high, low_samples=draw(st.integers(0, high)), byte_cap=cap)
    return SourceConfig(key=KEY, dataset_size=d, max_sample_bytes=10, max_seq_len=m, min_seq_len=s, students=students,
                        lag_cap_samples=draw(st.sampled_from([0, 2, 1 << 30])), nodes=nodes)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(any_layout_configs())
def test_multi_node_any_layout_preflight_is_sound(cfg):
    """Any layout on 2-3 nodes: preflight accepts ⇒ no interleaving and no length sequence stalls
    (soundness); a refusal by the per-node checks ⇒ a stall (necessity); a CrossNodeSkewError names
    the same rows the opt-in report lists, and the opt-in starts it with a warning."""
    try:
        report, refused = preflight(cfg), None
    except CrossNodeSkewError as e:
        report, refused = None, e
    except AdmissionConfigError as e:
        assume(not any(d["check"] in STRUCTURAL for d in e.details))
        report, refused = None, e
    res = _simulate_config(cfg)
    skewed = isinstance(refused, CrossNodeSkewError)
    event(("skew-refused" if skewed else "refused" if refused else "accepted") + (" stall" if res.stall else ""))
    if report is not None and any(v for row in report.skew.values() for v in row.values()):
        event("accepted with a positive skew bound")
    if report is not None:
        assert report.proven and not res.stall, (cfg, res)
        if report.same_order_on_all_nodes:
            assert all(v == 0 for row in report.skew.values() for v in row.values()), report.skew
    elif not skewed:
        assert res.stall, cfg
    else:
        cfg.allow_unproven_layout = True
        with pytest.warns(RuntimeWarning, match="allow_unproven_layout=True"):
            opt = preflight(cfg)
        assert not opt.proven and opt.unproven == refused.details
        assert all(d["need"] == d["share"] + d["skew"] > d["have"] for d in refused.details)


def test_cross_node_skew_is_refused_with_numbers_and_the_opt_in_starts_it():
    """Ranks (1, 3) vs (3, 1) over two nodes (12 positions per epoch each) pass every per-node check
    for H ≥ 3. Windows move the students apart ((k, 3k) vs (3k, k)) and need 2k + 3 in flight for k ≤ 3,
    so H ≤ 8 stalls on the skew and H = 9 runs. The skew bound is 6 (= 2·3), so preflight needs
    3 + 6 = 9: here it is tight. The opt-in starts H = 8 (and the simulator shows the stall the
    watchdog would then report)."""
    students = [StudentSpec(name="a", ranks_per_node={"n0": 1, "n1": 3}),
                StudentSpec(name="b", ranks_per_node={"n0": 3, "n1": 1})]
    for high in (3, 8):
        cfg = _cfg(high=high, low=0, students=students, nodes=("n0", "n1"), d=24)
        with pytest.raises(CrossNodeSkewError) as info:
            preflight(cfg)
        assert isinstance(info.value, AdmissionConfigError)
        msg = str(info.value)
        assert (f"node 'n1' student 'a': capacity {high} (high_samples={high}, byte_cap=0) < share 3 + "
                f"cross-node skew 6 against 'b' = 9") in msg, msg
        assert "node 'n0': high_samples >= 9" in msg and "allow_unproven_layout=True" in msg
        res = _simulate_config(cfg)
        (a0, a1), (b0, b1) = res.witness[1]
        assert res.stall and a0 < b0 and a1 > b1, res.witness  # each student is behind on one node
    cfg.allow_unproven_layout = True
    with pytest.warns(RuntimeWarning, match="watchdog"):
        report = preflight(cfg)
    assert not report.proven and {(d["node"], d["student"]) for d in report.unproven} == {("n0", "b"), ("n1", "a")}
    store = ShmStore()
    try:
        with pytest.warns(RuntimeWarning):
            src = SharedTeacherSource(cfg, store, monitor=False)
        assert not src.report.proven
        src.close()
    finally:
        store.close(remove=True)
    ok = _cfg(high=9, low=0, students=students, nodes=("n0", "n1"), d=24)
    report = preflight(ok)
    assert report.proven and report.skew == {"n0": {"a": 0, "b": 6}, "n1": {"a": 6, "b": 0}}
    assert not _simulate_config(ok).stall
    # a byte cap binds the same way: 8 objects fit, 9 are proven
    with pytest.raises(CrossNodeSkewError, match="byte_cap >= 900"):
        preflight(_cfg(high=20, low=0, cap=899, students=students, nodes=("n0", "n1"), d=24))
    preflight(_cfg(high=20, low=0, cap=900, students=students, nodes=("n0", "n1"), d=24))


def test_packed_tokens_bytes_and_topology_checks():
    packed = StudentSpec(name="p", ranks_per_node={"n0": 2}, packed=True, pack_budget_tokens=32,
                         accumulation_steps=2)  # T = 128 tokens → 32 samples of ≥ 4 tokens
    unpacked = StudentSpec(name="u", ranks_per_node={"n0": 2}, micro_batch_size=2)  # Q = 4 samples
    report = preflight(_cfg(high=32, low=0, students=[packed, unpacked], high_tokens=16, min_seq_len=4,
                            max_seq_len=32, cap=3200, max_bytes=100))
    assert report.needs == {"n0": {"p": 32, "u": 4}} and report.capacity == {"n0": 32}
    assert report.same_order_on_all_nodes
    with pytest.raises(AdmissionConfigError) as info:
        preflight(_cfg(high=16, low=8, students=[packed, unpacked], min_seq_len=4, max_seq_len=32, cap=1000,
                       max_bytes=100))
    checks = {(d["student"], d["check"]): (d["need"], d["have"]) for d in info.value.details}
    what = "ceil(quantum_tokens/min_seq_len) capped at epoch size"
    assert checks[("p", f"high_samples >= {what}")] == (32, 16)
    assert checks[("p", f"byte_cap >= ({what})*max_sample_bytes")] == (3200, 1000)
    assert ("u", "high_samples >= quantum") not in checks and len(checks) == 2
    with pytest.raises(AdmissionConfigError, match="pack_budget_tokens >= max_seq_len: need 64, have 32"):
        preflight(_cfg(high=64, low=63, students=[packed], max_seq_len=64))
    lonely = StudentSpec(name="lonely", ranks_per_node={"n0": 1})
    with pytest.raises(AdmissionConfigError, match="node 'n1' student 'lonely': ranks_on_node: need 1, have 0"):
        preflight(_cfg(high=8, low=8, students=[lonely], nodes=("n0", "n1")))
    big = StudentSpec(name="big", ranks_per_node={"n0": 8}, micro_batch_size=8)
    with pytest.raises(AdmissionConfigError, match="windows_per_epoch: need 1, have 0"):
        preflight(_cfg(high=64, low=64, students=[big], d=32))


def test_same_order_on_all_nodes_flag():
    two = ("n0", "n1")
    even = [StudentSpec(name="a", ranks_per_node={"n0": 1, "n1": 1}, micro_batch_size=2),
            StudentSpec(name="b", ranks_per_node={"n0": 2, "n1": 2}, micro_batch_size=1, accumulation_steps=3)]
    assert preflight(_cfg(high=8, low=0, students=even, nodes=two)).same_order_on_all_nodes
    skewed = [even[0], StudentSpec(name="c", ranks_per_node={"n0": 2, "n1": 1})]  # 32 positions per node
    report = preflight(_cfg(high=10, low=0, students=skewed, nodes=two))
    assert not report.same_order_on_all_nodes and report.skew == {"n0": {"a": 0, "c": 6}, "n1": {"a": 8, "c": 0}}
    packed = [even[0], StudentSpec(name="p", ranks_per_node={"n0": 1, "n1": 1}, packed=True, pack_budget_tokens=16)]
    report = preflight(_cfg(high=32, low=0, students=packed, nodes=two))  # packed: skew up to half the epoch
    assert not report.same_order_on_all_nodes and report.skew == {n: {"a": 16, "p": 15} for n in two}


@pytest.mark.parametrize("build, match", [
    (lambda: NodeLimits(high_samples=0, low_samples=0), r"NodeLimits.high_samples must be a positive int, got 0"),
    (lambda: NodeLimits(high_samples=4, low_samples=5), r"low_samples=5 must be <= high_samples=4"),
    (lambda: StudentSpec(name="a b", ranks_per_node={"n0": 1}), r"StudentSpec.name"),
    (lambda: StudentSpec(name="a", ranks_per_node={"n0": 0}), r"ranks_per_node must map node"),
    (lambda: StudentSpec(name="a", ranks_per_node={"n0": 1}, packed=True), r"pack_budget_tokens must be a positive"),
    (lambda: CompatKey(teacher_fingerprint="t", tokenizer="x", signals=["logits"]), r"unknown entries \['logits'\]"),
    (lambda: CompatKey(teacher_fingerprint="t", tokenizer="x", signals=["topk"], top_k=0), r"top_k must be a positive"),
    (lambda: _cfg(high=4, low=4, students=[StudentSpec(name="a", ranks_per_node={"n9": 1})]),
     r"names unknown nodes \['n9'\]"),
    (lambda: _cfg(high=4, low=4, students=[StudentSpec(name="a", ranks_per_node={"n0": 1})] * 2),
     r"duplicate names"),
])
def test_config_errors_name_field_and_value(build, match):
    with pytest.raises(SourceConfigError, match=match):
        build()


def test_configs_are_hydra_structured_configs():
    from omegaconf import OmegaConf

    node = OmegaConf.structured(NodeLimits(high_samples=8, low_samples=4))
    assert node.high_samples == 8
    spec = OmegaConf.to_object(OmegaConf.structured(StudentSpec(name="a", ranks_per_node={"n0": 2})))
    assert isinstance(spec, StudentSpec) and spec.quantum("n0") == 2
    cfg = OmegaConf.structured(_cfg(high=8, low=8, students=[StudentSpec(name="a", ranks_per_node={"n0": 2})]))
    cfg.nodes.n0.low_samples = 7  # override like a Hydra command line would
    back = OmegaConf.to_object(cfg)
    assert isinstance(back, SourceConfig) and back.nodes["n0"].low_samples == 7
    assert isinstance(back.key, CompatKey) and isinstance(back.students[0], StudentSpec)
    preflight(back)
