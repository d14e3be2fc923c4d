"""Every public config dataclass rejects malformed values at construction with a typed error that
names the field (issue: "a property-based test generates malformed values for every public config
dataclass"): NaN, a disallowed infinity, and values of the wrong type (including a plain dict where
a nested config is expected) must raise ``mcore_distill.errors.ConfigError`` — never
AttributeError/KeyError/IndexError/ZeroDivisionError, a NaN that slips through, or a hang.

Values are drawn by Hypothesis from the field's annotation, so a new field or config class is
covered without editing this file; ``VALID`` holds the arguments of classes whose defaults alone do
not construct.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import types
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_distill.errors import ConfigError

CONFIG_MODULES = (
    "mopd.config",
    "harts.config",
    "optim_staged.config",
    "colocate.config",
    "shared_teacher.config",
    "examples.demo.config",
    "examples.train.config",
    "examples.data.config",
)
EXTRA_CLASSES = ("harts.gdn.GdnTreeConfig",)


def _valid_args() -> dict[str, dict[str, typing.Any]]:
    from mopd.config import RoutingSpec, TeacherSpec
    from shared_teacher.config import CompatKey, NodeLimits, StudentSpec

    key = CompatKey(teacher_fingerprint="t", tokenizer="tok")
    return {
        "MOPDConfig": dict(teachers={"a": TeacherSpec()}, routing=RoutingSpec(routes={"r": {"a": 1.0}})),
        "HFModelSpec": dict(arch="qwen3", num_layers=2, hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, head_dim=16, ffn_hidden_size=128, vocab_size=256),
        "WorkerSpec": dict(role="engine", command=["python", "-c", "pass"]),
        "SGLangServerConfig": dict(model_path="/ckpt"),
        "CompatKey": dict(teacher_fingerprint="t", tokenizer="tok"),
        "NodeLimits": dict(high_samples=8, low_samples=4),
        "StudentSpec": dict(name="s", ranks_per_node={"n0": 1}),
        "SourceConfig": dict(key=key, nodes={"n0": NodeLimits(high_samples=64, low_samples=32)},
                             students=[StudentSpec(name="s", ranks_per_node={"n0": 1})],
                             dataset_size=16, max_sample_bytes=1 << 20, max_seq_len=64),
        "MathDataConfig": dict(path="data.jsonl"),
    }


def _config_classes() -> list[type]:
    out = []
    for name in CONFIG_MODULES:
        mod = importlib.import_module(name)
        for attr in getattr(mod, "__all__", ()):
            obj = getattr(mod, attr)
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == name:
                out.append(obj)
    for path in EXTRA_CLASSES:
        mod, _, attr = path.rpartition(".")
        out.append(getattr(importlib.import_module(mod), attr))
    return out


CLASSES = _config_classes()


def _valid(cls: type):
    return cls(**_valid_args().get(cls.__name__, {}))


class _Junk:
    """An object of no expected type."""


def _wrong_type_values(tp: typing.Any) -> list[typing.Any]:
    """Values that are not of annotation ``tp`` (and not coercible to it)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    allows_none = origin in (typing.Union, types.UnionType) and type(None) in args
    if allows_none:
        inner = [a for a in args if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else tp
        origin = typing.get_origin(tp)
    candidates: list[typing.Any] = [_Junk(), object]
    if not allows_none:
        candidates.append(None)
    base = origin or tp
    if base is bool:
        candidates += ["yes", 1, 1.0]
    elif base is int:
        candidates += ["3", 2.5, True, [1]]
    elif base is float:
        candidates += ["0.5", True, [0.5], {"x": 1.0}]
    elif base is str:
        candidates += [3, 2.5, ["a"], True]
    elif base in (list, tuple):
        candidates += ["abc", 3, {"a": 1}]
    elif base is dict:
        candidates += [[("a", 1)], "a=1", 3]
    elif isinstance(base, type) and issubclass(base, enum.Enum):
        candidates += [3, 2.5, ["x"]]
    elif isinstance(base, type) and dataclasses.is_dataclass(base):
        candidates += [{"x": 1}, 3, "cfg"]
    return candidates


def _float_fields(cls: type) -> list[tuple[str, bool]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = typing.get_args(tp) or (tp,)
        if float in args:
            out.append((f.name, bool(f.metadata.get("allow_inf"))))
    return out


def _assert_rejected(cls: type, name: str, value: typing.Any) -> None:
    base = _valid(cls)
    try:
        got = dataclasses.replace(base, **{name: value})
    except ConfigError as e:
        assert name in str(e), f"{cls.__name__}.{name}={value!r}: the error does not name the field: {e}"
        return
    except Exception as e:  # noqa: BLE001 - the point is to show what escaped
        pytest.fail(f"{cls.__name__}.{name}={value!r} raised untyped {type(e).__name__}: {e}")
    pytest.fail(f"{cls.__name__}.{name}={value!r} was accepted (got {getattr(got, name)!r})")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_defaults_or_valid_args_construct(cls):
    _valid(cls)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_wrong_types_raise_a_config_error_naming_the_field(cls, data):
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and hints[f.name] is not typing.Any]
    f = data.draw(st.sampled_from(fields), label="field")
    value = data.draw(st.sampled_from(_wrong_type_values(hints[f.name])), label="value")
    _assert_rejected(cls, f.name, value)


@pytest.mark.parametrize("cls", [c for c in CLASSES if _float_fields(c)], ids=lambda c: c.__name__)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_non_finite_numbers_raise_a_config_error_naming_the_field(cls, data):
    name, allow_inf = data.draw(st.sampled_from(_float_fields(cls)), label="field")
    bad = [math.nan] if allow_inf else [math.nan, math.inf, -math.inf]
    _assert_rejected(cls, name, data.draw(st.sampled_from(bad), label="value"))


def test_fields_that_allow_inf_take_it():
    """``inf`` is meaningful where a field says so (e.g. ``fallback_compression=inf``: always pack
    THD, as the THD providers of bench/harts.py plan); NaN is still refused there."""
    from harts.config import PlannerConfig
    from mopd.config import TeacherTreeConfig

    assert PlannerConfig(fallback_compression=math.inf).fallback_compression == math.inf
    assert TeacherTreeConfig(fallback_compression=math.inf).fallback_compression == math.inf
    for cls in (PlannerConfig, TeacherTreeConfig):
        with pytest.raises(ConfigError, match="fallback_compression"):
            cls(fallback_compression=math.nan)
