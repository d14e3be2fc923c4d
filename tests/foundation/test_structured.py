"""mcore_distill.structured: keys that are no field are refused by name (nested dataclasses, dict
values that are dataclasses), with the closest field and the valid keys; good configs build."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from mcore_distill.errors import ConfigError
from mcore_distill.structured import to_dataclass, unknown_keys


@dataclasses.dataclass(kw_only=True)
class Inner:
    steps: int = 3
    """Steps."""
    lr: float = 0.1
    """LR."""


@dataclasses.dataclass(kw_only=True)
class Outer:
    name: str = "x"
    inner: Inner = dataclasses.field(default_factory=Inner)
    maybe: Inner | None = None
    many: dict[str, Inner] = dataclasses.field(default_factory=dict)
    free: dict[str, float] = dataclasses.field(default_factory=dict)


def test_good_config_builds():
    node = OmegaConf.create({"inner": {"steps": 5}, "maybe": {"lr": 0.5}, "many": {"a": {"steps": 1}},
                             "free": {"anything": 1.0}})
    out = to_dataclass(node, Outer)
    assert out.inner.steps == 5 and out.maybe.lr == 0.5 and out.many["a"] == Inner(steps=1)
    assert out.free == {"anything": 1.0}


def test_unknown_keys_are_named_with_the_valid_ones():
    node = {"nme": "y", "inner": {"stepz": 2}, "maybe": {"l": 1.0}, "many": {"a": {"lrr": 1.0}}, "free": {"z": 1.0}}
    assert [k.path for k in unknown_keys(node, Outer)] == ["nme", "inner.stepz", "maybe.l", "many.a.lrr"]
    with pytest.raises(ConfigError) as e:
        to_dataclass(OmegaConf.create(node), Outer, where="cfg.yaml")
    msg = str(e.value)
    assert msg.startswith("unknown config keys in cfg.yaml: 'nme': Outer has no field 'nme' (did you mean 'name'?)")
    assert "'inner.stepz': Inner has no field 'stepz' (did you mean 'steps'?); valid keys: lr, steps" in msg
    assert "'many.a.lrr': Inner has no field 'lrr' (did you mean 'lr'?)" in msg


def test_hydra_appended_key_on_a_typed_node_is_refused():
    """What Hydra's ``+inner.stepz=1`` leaves in a composed config: the key on a typed node."""
    cfg = OmegaConf.structured(Outer)
    OmegaConf.update(cfg, "inner.stepz", 1, force_add=True)  # what Hydra does for "+key"
    assert OmegaConf.to_object(cfg).inner == Inner()  # OmegaConf alone drops it silently
    with pytest.raises(KeyError, match="inner.stepz"):
        to_dataclass(cfg, Outer, error=KeyError)
