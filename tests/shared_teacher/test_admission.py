"""Preflight vs the exhaustive simulator, named errors with numbers, config validation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared_teacher import (
    AdmissionConfigError,
    CompatKey,
    NodeLimits,
    SourceConfig,
    SourceConfigError,
    StudentSpec,
    preflight,
    residue_bound,
    simulate_node,
)

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
    assert simulate_node(windows=[(8, 8)], epoch_size=64, high=6, low=6).stall


def test_hysteresis_remainder_is_refused():
    """H = 250, Q = 64: after three windows 58 remain; a low watermark below 58 strands them."""
    s = StudentSpec(name="draft", ranks_per_node={"n0": 8}, micro_batch_size=8)
    assert residue_bound(250, 640, [(64, 10)]) == 58
    for low in (0, 57):
        with pytest.raises(AdmissionConfigError, match="low_samples >= remainder after drain: need 58, have"):
            preflight(_cfg(high=250, low=low, students=[s], d=640))
        assert simulate_node(windows=[(64, 10)], epoch_size=640, high=250, low=low).stall
    preflight(_cfg(high=250, low=58, students=[s], d=640))
    assert not simulate_node(windows=[(64, 10)], epoch_size=640, high=250, low=58).stall
    # H a multiple of Q leaves no remainder: L = 0 is fine
    preflight(_cfg(high=256, low=0, students=[s], d=640))
    assert not simulate_node(windows=[(64, 10)], epoch_size=640, high=256, low=0).stall


def _sim(qs, d, high, low, cap, lag):
    ks = [d // q for q in qs]
    return simulate_node(windows=list(zip(qs, ks)), epoch_size=d, high=high, low=low, byte_cap_samples=cap,
                         lag_cap=lag)


def _preflight_ok(qs, d, high, low, cap, lag):
    students = [StudentSpec(name=f"s{i}", ranks_per_node={"n0": 1}, micro_batch_size=q) for i, q in enumerate(qs)]
    cfg = SourceConfig(key=KEY, dataset_size=d, max_sample_bytes=10, max_seq_len=8, students=students,
                       lag_cap_samples=lag, nodes={"n0": NodeLimits(high_samples=high, low_samples=low,
                                                                    byte_cap=cap * 10)})
    try:
        preflight(cfg)
        return True
    except AdmissionConfigError:
        return False


@st.composite
def node_configs(draw, *, same_quantum: bool):
    m = draw(st.integers(1, 3))
    q0 = draw(st.integers(1, 6))
    qs = [q0] * m if same_quantum else [draw(st.integers(1, 6)) for _ in range(m)]
    d = draw(st.integers(max(qs), 18))
    high = draw(st.integers(1, 16))
    low = draw(st.integers(0, high))
    lag = draw(st.sampled_from([0, 1, 3, 1 << 30]))
    # byte caps that are either too small (overflow) or do not mask the latch (>= high samples)
    cap = draw(st.one_of(st.just(0), st.integers(1, max(qs) - 1) if max(qs) > 1 else st.just(0),
                         st.integers(high, 30)))
    return qs, d, high, low, cap, lag


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node_configs(same_quantum=True))
def test_preflight_rejects_exactly_the_stalling_configs_single_quantum(case):
    """One window size per node (any number of students): preflight == 'the simulator never stalls'."""
    qs, d, high, low, cap, lag = case
    res = _sim(qs, d, high, low, cap, lag)
    assert _preflight_ok(qs, d, high, low, cap, lag) == (not res.stall and not res.overflow), (case, res)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node_configs(same_quantum=False))
def test_preflight_is_sound_with_mixed_quanta(case):
    """Different window sizes: everything preflight accepts runs without a stall or overflow, and every
    config with H < max Q, a byte cap below one quantum, or L below the single-student remainder is refused."""
    qs, d, high, low, cap, lag = case
    res = _sim(qs, d, high, low, cap, lag)
    if _preflight_ok(qs, d, high, low, cap, lag):
        assert not res.stall and not res.overflow, (case, res)
    if high < max(qs) or (cap and cap < max(qs)):
        assert res.stall or res.overflow, case


def test_mixed_quanta_conservative_example():
    """A documented case where preflight refuses a config the simulator finds safe (it is conservative)."""
    qs, d, high, low = [6, 3, 3], 6, 6, 2
    assert not _sim(qs, d, high, low, 0, 1 << 30).stall
    assert not _preflight_ok(qs, d, high, low, 0, 1 << 30)


def test_packed_tokens_bytes_and_topology_checks():
    packed = StudentSpec(name="p", ranks_per_node={"n0": 2}, packed=True, pack_budget_tokens=32,
                         accumulation_steps=2)  # T = 128 tokens
    unpacked = StudentSpec(name="u", ranks_per_node={"n0": 2}, micro_batch_size=2)  # Q = 4 samples
    ok = _cfg(high=32, low=31, students=[packed, unpacked], high_tokens=128, low_tokens=127, min_seq_len=4,
              max_seq_len=32, cap=3200, max_bytes=100)
    preflight(ok)
    with pytest.raises(AdmissionConfigError) as info:
        preflight(_cfg(high=16, low=8, students=[packed, unpacked], high_tokens=100, low_tokens=50, min_seq_len=4,
                       max_seq_len=32, cap=1000, max_bytes=100))
    checks = {(d["student"], d["check"]): (d["need"], d["have"]) for d in info.value.details}
    assert checks[("p", "high_samples >= ceil(quantum_tokens/min_seq_len)")] == (32, 16)
    assert checks[("p", "low_samples >= floor((quantum_tokens-1)/min_seq_len)")] == (31, 8)
    assert checks[("p", "high_tokens >= quantum_tokens")] == (128, 100)
    assert checks[("u", "high_tokens >= quantum*max_seq_len")] == (128, 100)
    assert checks[("p", "byte_cap >= quantum_samples*max_sample_bytes")] == (3200, 1000)
    with pytest.raises(AdmissionConfigError, match="pack_budget_tokens >= max_seq_len: need 64, have 32"):
        preflight(_cfg(high=64, low=63, students=[packed], max_seq_len=64))
    lonely = StudentSpec(name="lonely", ranks_per_node={"n0": 1})
    with pytest.raises(AdmissionConfigError, match="node 'n1' student 'lonely': ranks_on_node: need 1, have 0"):
        preflight(_cfg(high=8, low=8, students=[lonely], nodes=("n0", "n1")))
    big = StudentSpec(name="big", ranks_per_node={"n0": 8}, micro_batch_size=8)
    with pytest.raises(AdmissionConfigError, match="windows_per_epoch: need 1, have 0"):
        preflight(_cfg(high=64, low=64, students=[big], d=32))


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
