"""mcore_distill.validate: field checks by annotation, typed errors naming Class.field."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import pytest

from mcore_distill.errors import ConfigError, ConfigTypeError
from mcore_distill.validate import check_choice, check_number, check_type, validate_fields


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(kw_only=True, slots=True)
class Inner:
    k: int = 1

    def __post_init__(self):
        validate_fields(self, type_error=ConfigTypeError)


@dataclass(kw_only=True, slots=True)
class Outer:
    lr: float = 1e-3
    cap: float = math.inf
    steps: int = 10
    flag: bool = False
    name: str = "x"
    color: Color = Color.RED
    maybe: float | None = None
    inner: Inner = field(default_factory=Inner)
    ids: list[int] = field(default_factory=list)
    pair: tuple[float, float] = (0.9, 0.99)
    table: dict[str, float] = field(default_factory=dict)
    limit: float = field(default=1.0, metadata={"allow_inf": True})

    def __post_init__(self):
        validate_fields(self, type_error=ConfigTypeError, allow_inf=("cap",))


def test_valid_and_enum_from_string():
    o = Outer(color="blue", maybe=2, ids=[1, 2], table={"a": 1.0})
    assert o.color is Color.BLUE
    assert Outer(color="RED").color is Color.RED
    assert Outer(pair=[0.5, 0.6]).pair == (0.5, 0.6)  # OmegaConf hands tuples over as lists


@pytest.mark.parametrize("kw, cls, needle", [
    ({"lr": math.nan}, ConfigError, "Outer.lr"),
    ({"lr": math.inf}, ConfigError, "Outer.lr"),
    ({"lr": "1e-3"}, ConfigTypeError, "Outer.lr"),
    ({"lr": True}, ConfigTypeError, "Outer.lr"),
    ({"steps": 1.5}, ConfigTypeError, "Outer.steps"),
    ({"flag": 1}, ConfigTypeError, "Outer.flag"),
    ({"name": 3}, ConfigTypeError, "Outer.name"),
    ({"color": "green"}, ConfigError, "Outer.color"),
    ({"maybe": math.nan}, ConfigError, "Outer.maybe"),
    ({"inner": {"k": 1}}, ConfigTypeError, "Outer.inner"),
    ({"ids": [1, "2"]}, ConfigTypeError, "Outer.ids"),
    ({"ids": (1, 2)}, ConfigTypeError, "Outer.ids"),
    ({"table": {"a": math.nan}}, ConfigError, "Outer.table"),
    ({"table": [1.0]}, ConfigTypeError, "Outer.table"),
    ({"pair": (0.5,)}, ConfigTypeError, "Outer.pair"),
    ({"pair": (0.5, math.nan)}, ConfigError, "Outer.pair"),
], ids=lambda v: str(v))
def test_bad_fields_raise_typed_errors_naming_the_field(kw, cls, needle):
    with pytest.raises(cls, match=needle):
        Outer(**kw)


def test_allow_inf_and_nested():
    assert Outer(cap=-math.inf).cap == -math.inf
    assert Outer(limit=math.inf).limit == math.inf
    with pytest.raises(ConfigError, match="Outer.limit"):
        Outer(limit=math.nan)
    with pytest.raises(ConfigTypeError, match="Inner.k"):
        Inner(k="1")


def test_scalar_checks():
    assert check_number("x", 3, integer=True, positive=True) == 3
    with pytest.raises(ConfigError, match="x must be > 0"):
        check_number("x", 0, positive=True)
    with pytest.raises(ConfigError, match="x must be a finite"):
        check_number("x", math.nan, nonneg=True)
    with pytest.raises(ConfigError, match=r"x must be <= 1"):
        check_number("x", 2.0, hi=1)
    assert check_choice("c", "red", Color) is Color.RED
    with pytest.raises(ConfigError, match="c must be one of"):
        check_choice("c", "x", Color)
    with pytest.raises(ConfigTypeError, match="pool must be a mapping"):
        check_type("pool", [1], dict[str, int])
