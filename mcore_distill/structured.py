"""Structured configs from YAML, Hydra or dotlists without silently dropped keys.

A key that is no field of the schema can reach a composed config: Hydra's ``+key=value`` appends
it, and a YAML merged into an untyped node keeps it. ``OmegaConf.to_object`` then builds the
dataclass and drops the key without a word, so a misspelled ``+mopd.stepz=1`` runs the default.
:func:`to_dataclass` refuses such keys first, naming each one with its class, the closest field
and the valid keys; then it merges into the schema (types checked by OmegaConf) and builds the
dataclass (``__post_init__`` validation runs).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

from mcore_distill.errors import ConfigError

__all__ = ["UnknownKey", "unknown_keys", "to_dataclass"]


@dataclasses.dataclass(frozen=True, slots=True)
class UnknownKey:
    """A key of a config node that is no field of the dataclass at its place."""

    path: str
    """Dotted path of the key, e.g. ``mopd.stepz``."""
    cls: type
    """The dataclass the key was looked up in."""

    @property
    def valid(self) -> list[str]:
        """The field names of :attr:`cls`, sorted."""
        return sorted(f.name for f in dataclasses.fields(self.cls) if f.init)

    def describe(self) -> str:
        key = self.path.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(key, self.valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (f"{self.path!r}: {self.cls.__name__} has no field {key!r}{hint}; "
                f"valid keys: {', '.join(self.valid)}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_in(tp: Any) -> tuple[type | None, bool]:
    """``(dataclass, is_mapping_of_them)`` named by a field annotation: ``C``, ``C | None`` or
    ``dict[str, C]``; ``(None, False)`` for anything else."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            found = _dataclass_in(arg)
            if found[0] is not None:
                return found
        return None, False
    if origin is dict:
        args = typing.get_args(tp)
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):
            return args[1], True
        return None, False
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp, False
    return None, False


def _is_mapping(node: Any) -> bool:
    if isinstance(node, Mapping):
        return True
    try:
        from omegaconf import DictConfig
    except ImportError:  # pragma: no cover - omegaconf comes with hydra-core
        return False
    return isinstance(node, DictConfig)


def unknown_keys(node: Any, cls: type, prefix: str = "") -> list[UnknownKey]:
    """Keys of the mapping ``node`` (a dict or OmegaConf ``DictConfig``, nested) that are no
    field of the dataclass ``cls`` at their place; nested dataclass fields and ``dict[str, C]``
    fields of dataclasses ``C`` are checked too, other mappings are free-form."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    out = []
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in fields:
            out.append(UnknownKey(path, cls))
            continue
        sub, mapping = _dataclass_in(hints.get(key, Any))
        value = node[key]
        if sub is None or not _is_mapping(value):
            continue
        if mapping:
            for name in value.keys():
                if _is_mapping(value[name]):
                    out += unknown_keys(value[name], sub, f"{path}.{name}.")
        else:
            out += unknown_keys(value, sub, f"{path}.")
    return out


def to_dataclass(node: Any, cls: type, *, error: type[Exception] = ConfigError, where: str = "") -> Any:
    """Build the dataclass ``cls`` from ``node`` (a mapping or OmegaConf/Hydra ``DictConfig``).

    Raises ``error`` listing every key that is no field (see :func:`unknown_keys`), ``error``
    naming the key for a value OmegaConf refuses (wrong type, not a member of an ``Enum`` field;
    OmegaConf's ``ValidationError`` is its cause), and whatever ``cls.__post_init__`` raises.
    ``where`` names the source in the message (e.g. the YAML file).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    bad = unknown_keys(node, cls)
    if bad:
        src = f" in {where}" if where else ""
        raise error(f"unknown config key{'s' if len(bad) > 1 else ''}{src}: "
                    + "; ".join(k.describe() for k in bad))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), node)
    except ValidationError as e:
        src = f" in {where}" if where else ""
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise error(f"{e.full_key or cls.__name__}{src}: {first}") from e
    return OmegaConf.to_object(merged)
