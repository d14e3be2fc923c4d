"""Package-level contracts: every package imports on a CPU machine without pulling heavy deps, exports
only its user surface, and roots its errors at one base class."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

PACKAGES = ["mcore_distill", "mopd", "harts", "optim_staged", "colocate", "shared_teacher"]
HEAVY = ("megatron", "sglang", "transformer_engine", "transformers", "awex", "fla.ops", "triton")


@pytest.mark.parametrize("package", PACKAGES)
def test_import_is_light(package):
    code = (
        f"import sys, {package}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith('fla.ops'))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import {package} pulled in: {out.stdout.strip()}"


# Each package's ``__init__`` re-exports only what a trainer calls; everything else is imported
# from its module. colocate pins its own surface in tests/colocate (it is being cut separately).
MAX_EXPORTS = 25
SURFACE = {  # package: (its base error, its config error), both exported
    "mcore_distill": ("McoreDistillError", "ConfigError"),
    "mopd": ("MOPDError", "ConfigError"),
    "harts": ("HartsError", "HartsConfigError"),
    "optim_staged": ("StagedError", "StagedConfigError"),
    "shared_teacher": ("SharedTeacherError", "SourceConfigError"),
    "colocate": ("ColocateError", "ConfigError"),
}


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_package_exports_only_its_user_surface(package):
    pkg = importlib.import_module(package)
    names = pkg.__all__
    assert len(names) == len(set(names)), f"{package}.__all__ repeats a name"
    assert len(names) <= MAX_EXPORTS, f"{package} exports {len(names)} names (> {MAX_EXPORTS}): {sorted(names)}"
    for name in names:
        obj = getattr(pkg, name)  # resolves; Megatron entry points load on first access
        assert getattr(obj, "__module__", None) != package, f"{package}.{name} is defined in __init__"
    public = {n for n, v in vars(pkg).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public <= set(names), f"{package} has names at package level outside __all__: {public - set(names)}"
    base, config = SURFACE[package]
    assert {base, config} <= set(names)
    assert issubclass(getattr(pkg, config), getattr(pkg, base))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        pkg.no_such_name  # noqa: B018


@pytest.mark.parametrize("package", sorted(SURFACE))
def test_every_error_of_a_package_derives_from_its_one_base(package):
    """Each package has ``errors.py`` with one base class (a ``McoreDistillError``); every public
    exception class of the package derives from it, and in the plugin packages is defined there."""
    from mcore_distill.errors import McoreDistillError

    base = getattr(importlib.import_module(f"{package}.errors"), SURFACE[package][0])
    assert issubclass(base, McoreDistillError)
    found = []
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, f"{package}."):
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name \
                    and not name.startswith("_"):
                found.append(name)
                assert issubclass(obj, base), f"{info.name}.{name} does not derive from {base.__qualname__}"
                if package != "mcore_distill":  # the foundation's subpackages (hf, testing) keep their own
                    assert info.name == f"{package}.errors", f"{info.name}.{name} is not in {package}/errors.py"
    assert base.__name__ in found
