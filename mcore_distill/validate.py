"""Validation of config dataclasses: one set of checks for every package's ``config.py``.

:func:`validate_fields` checks each field of a dataclass instance against its annotation (bool,
int, float, str, ``Enum``, nested config dataclass, ``X | None``, ``list``/``tuple``/``dict`` of
those) and rejects NaN everywhere and infinity unless the field is listed in ``allow_inf``. It is
meant to run first in ``__post_init__`` (which ``OmegaConf.to_object`` calls too), so a wrong type
or a non-finite number fails at construction with an error naming ``Class.field``. Strings are
converted to ``Enum`` members (by value or name), so ``backend="varlen"`` works where the field is
an ``AttentionBackend``. :func:`check_number` and :func:`check_choice` are the per-value checks
for range rules and function arguments.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import types
import typing
from collections.abc import Iterable
from typing import Any

from mcore_distill.errors import ConfigError, ConfigTypeError

__all__ = ["validate_fields", "check_number", "check_choice", "check_type"]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


class _Mismatch(Exception):
    def __init__(self, message: str, *, is_type: bool = True) -> None:
        super().__init__(message)
        self.is_type = is_type


def _finite(value: float, allow_inf: bool) -> None:
    if math.isnan(value):
        raise _Mismatch("a finite number, got nan", is_type=False)
    if math.isinf(value) and not allow_inf:
        raise _Mismatch(f"a finite number, got {value!r}", is_type=False)


def _check_item(tp: Any, i: int, item: Any, item_tp: Any, allow_inf: bool) -> Any:
    try:
        return _check(item, item_tp, allow_inf)
    except _Mismatch as e:
        raise _Mismatch(f"{_describe(tp)}; item {i}: expected {e}", is_type=e.is_type) from None


def _check(value: Any, tp: Any, allow_inf: bool) -> Any:
    """Return ``value`` (an Enum member where a str named one) or raise :class:`_Mismatch`."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, allow_inf)
            except _Mismatch as e:
                if not e.is_type:  # right type, bad value: report that
                    raise
                errors.append(_describe(arg))
        raise _Mismatch(f"one of {' | '.join(_describe(a) for a in args)}, got {value!r} "
                        f"({type(value).__name__})")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise _Mismatch(f"one of {typing.get_args(tp)}, got {value!r}", is_type=False)
        return value
    if origin in (list, tuple, set, frozenset, Iterable) or tp in (list, tuple):
        container = origin or tp
        # a tuple field also takes a list (OmegaConf hands YAML sequences over as lists)
        accepted = {tuple: (tuple, list), Iterable: (list, tuple)}.get(container, container)
        if not isinstance(value, accepted) or isinstance(value, str):
            raise _Mismatch(f"a {_describe(tp)}, got {value!r} ({type(value).__name__})")
        args = typing.get_args(tp)
        if container is tuple and args and Ellipsis not in args:
            if len(args) != len(value):
                raise _Mismatch(f"a {_describe(tp)} of {len(args)} items, got {value!r}")
            items = [_check_item(tp, i, v, a, allow_inf) for i, (v, a) in enumerate(zip(value, args))]
        elif args:
            items = [_check_item(tp, i, v, args[0], allow_inf) for i, v in enumerate(value)]
        else:
            items = list(value)
        if container is tuple:
            return tuple(items) if (isinstance(value, list) or items != list(value)) else value
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _Mismatch(f"a mapping, got {value!r} ({type(value).__name__})")
        args = typing.get_args(tp)
        if len(args) == 2:
            for k, v in value.items():
                try:
                    _check(k, args[0], allow_inf)
                    _check(v, args[1], allow_inf)
                except _Mismatch as e:
                    raise _Mismatch(f"{_describe(tp)}; entry {k!r}: expected {e}", is_type=e.is_type) from None
        return value
    if not isinstance(tp, type):
        return value  # TypeVar, forward reference, etc.: not checked
    if issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        if isinstance(value, str):
            for member in tp:
                if value in (member.value, member.name):
                    return member
        valid = [m.value for m in tp]
        raise _Mismatch(f"one of {valid}, got {value!r}", is_type=not isinstance(value, str))
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch(f"a bool, got {value!r} ({type(value).__name__})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch(f"an int, got {value!r} ({type(value).__name__})")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            kind = "a number" if allow_inf else "a finite number"
            raise _Mismatch(f"{kind}, got {value!r} ({type(value).__name__})")
        _finite(float(value), allow_inf)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _Mismatch(f"a str, got {value!r} ({type(value).__name__})")
        return value
    if tp in (os.PathLike,) or tp.__name__ == "Path":
        if not isinstance(value, str | os.PathLike):
            raise _Mismatch(f"a path, got {value!r} ({type(value).__name__})")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        hint = " (a plain dict: build the dataclass from it)" if isinstance(value, dict) else ""
        raise _Mismatch(f"a {tp.__name__}, got {type(value).__name__}{hint}")
    if not isinstance(value, tp):
        raise _Mismatch(f"a {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value


def validate_fields(obj: Any, *, error: type[Exception] = ConfigError,
                    type_error: type[Exception] | None = None, name: str | None = None,
                    allow_inf: Iterable[str] = (), skip: Iterable[str] = ()) -> None:
    """Check every field of the dataclass ``obj`` against its annotation.

    Raises ``type_error`` (default ``error``) for a value of the wrong type and ``error`` for NaN,
    a disallowed infinity or a str that names no member of an ``Enum`` field; the message starts
    with ``Class.field`` (``name.field`` when ``name`` is given, e.g. the config's section in a
    YAML file). A str given for an ``Enum`` field is replaced by the member; a list given for a
    ``tuple`` field by a tuple.
    ``allow_inf`` lists float fields where ``±inf`` means "no limit" (a field can also say so
    itself with ``field(..., metadata={"allow_inf": True})``); ``skip`` lists fields checked
    elsewhere.
    """
    cls = type(obj)
    hints = _hints(cls)
    allow, skipped = set(allow_inf), set(skip)
    for f in dataclasses.fields(obj):
        if f.name in skipped or not f.init:
            continue
        value = getattr(obj, f.name)
        try:
            checked = _check(value, hints.get(f.name, Any),
                             f.name in allow or bool(f.metadata.get("allow_inf")))
        except _Mismatch as e:
            exc = (type_error or error) if e.is_type else error
            raise exc(f"{name or cls.__name__}.{f.name} must be {e}") from None
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def check_number(name: str, value: Any, *, integer: bool = False, positive: bool = False,
                 nonneg: bool = False, lo: float | None = None, hi: float | None = None,
                 allow_inf: bool = False, error: type[Exception] = ConfigError,
                 type_error: type[Exception] | None = None) -> Any:
    """Return ``value`` if it is a (finite unless ``allow_inf``) number obeying the bounds
    (``positive``: > 0, ``nonneg``: ≥ 0, ``lo ≤ value ≤ hi``); raise naming ``name`` otherwise."""
    tp = int if integer else float
    try:
        _check(value, tp, allow_inf)
    except _Mismatch as e:
        raise ((type_error or error) if e.is_type else error)(f"{name} must be {e}") from None
    if positive and not value > 0:
        raise error(f"{name} must be > 0, got {value!r}")
    if nonneg and not value >= 0:
        raise error(f"{name} must be >= 0, got {value!r}")
    if lo is not None and not value >= lo:
        raise error(f"{name} must be >= {lo}, got {value!r}")
    if hi is not None and not value <= hi:
        raise error(f"{name} must be <= {hi}, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: type[enum.Enum], *,
                 error: type[Exception] = ConfigError) -> enum.Enum:
    """Return the member of the ``Enum`` ``choices`` that ``value`` is or names (by value or
    name); raise ``error`` listing the valid values otherwise."""
    try:
        return _check(value, choices, False)
    except _Mismatch as e:
        raise error(f"{name} must be {e}") from None


def check_type(name: str, value: Any, expected: Any, *,
               error: type[Exception] = ConfigTypeError) -> Any:
    """Return ``value`` if it matches the annotation ``expected`` (as :func:`validate_fields`
    checks fields); raise ``error`` naming ``name`` otherwise. For public function arguments."""
    try:
        return _check(value, expected, True)
    except _Mismatch as e:
        raise error(f"{name} must be {e}") from None
