"""Regenerate the generated parts of docs/ from the code, or check that they are current.

    python scripts/docgen.py            # rewrite every generated block
    python scripts/docgen.py --check    # exit 1 and name the stale blocks (what the tests run)

Blocks sit between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->``:

* ``config-reference`` (docs/config.md): one table per config dataclass, built from the field
  annotations, defaults and the docstring under each field;
* ``integration-diff`` (docs/integration.md): the unified diff from
  examples/megatron_integration/plain.py to train.py.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import enum
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = [  # (module, class): top-level classes first, then the ones they nest
    ("mopd.config", "MOPDConfig"),
    ("mopd.config", "TeacherSpec"),
    ("mopd.config", "RoutingSpec"),
    ("mopd.config", "MOPDLossConfig"),
    ("mopd.config", "DivergenceConfig"),
    ("mopd.config", "TeacherPoolConfig"),
    ("mopd.config", "TeacherTreeConfig"),
    ("optim_staged.config", "StagedOptimizerConfig"),
    ("optim_staged.config", "SlotConfig"),
    ("optim_staged.config", "AdamWConfig"),
    ("optim_staged.config", "MuonConfig"),
    ("harts.config", "PlannerConfig"),
    ("harts.config", "CostModelConfig"),
]


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the string literal under each annotated field of ``cls``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def _annotations(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {s.target.id: ast.unparse(s.annotation) for s in tree.body[0].body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return f"`{type(value).__name__}()`"
    else:
        return "required"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """One table cell: one line, RST roles and double backquotes as Markdown code, ``|`` escaped."""
    text = re.sub(r":(?:class|func|meth|mod|data|attr|exc):`~?([^`]+)`", r"`\1`", text)
    return " ".join(text.replace("``", "`").split()).replace("|", "\\|")


def config_reference() -> str:
    """Markdown: a section and a table per class of :data:`CONFIGS`."""
    parts = []
    for module, name in CONFIGS:
        cls = getattr(importlib.import_module(module), name)
        docs, ann = field_docs(cls), _annotations(cls)
        summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
        lines = [f"### `{name}` (`{module}`)", "", _cell(summary), "",
                 "| field | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            lines.append(f"| `{f.name}` | `{_cell(ann.get(f.name, '?'))}` | {_default(f)} | "
                         f"{_cell(docs.get(f.name, '(no docstring)'))} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def integration_diff() -> str:
    """Unified diff examples/megatron_integration/plain.py → train.py."""
    d = ROOT / "examples" / "megatron_integration"
    a = (d / "plain.py").read_text().splitlines(keepends=True)
    b = (d / "train.py").read_text().splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, fromfile="plain.py", tofile="train.py", n=2))


BLOCKS = {  # name: (doc file, generator, fence)
    "config-reference": ("docs/config.md", config_reference, None),
    "integration-diff": ("docs/integration.md", integration_diff, "diff"),
}


def _block_re(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- BEGIN GENERATED: {re.escape(name)} -->\n)(.*?)(<!-- END GENERATED: {re.escape(name)} -->)",
                      re.S)


def _render(name: str) -> str:
    _, gen, fence = BLOCKS[name]
    body = gen().rstrip("\n") + "\n"
    return f"```{fence}\n{body}```\n" if fence else body


def check(*names: str) -> list[str]:
    """Names of the generated blocks (all by default; a prefix such as ``integration`` selects)
    whose text in docs/ differs from what the code generates now (or that are missing)."""
    stale = []
    for name, (path, _, _) in BLOCKS.items():
        if names and not any(name.startswith(n) for n in names):
            continue
        m = _block_re(name).search((ROOT / path).read_text())
        if m is None or m.group(2) != _render(name):
            stale.append(name)
    return stale


def write() -> list[str]:
    """Rewrite every generated block; returns the names that changed."""
    changed = []
    for name, (path, _, _) in BLOCKS.items():
        p = ROOT / path
        text = p.read_text()
        m = _block_re(name).search(text)
        if m is None:
            raise SystemExit(f"{path}: no '<!-- BEGIN GENERATED: {name} -->' ... END block to fill")
        new = text[:m.start(2)] + _render(name) + text[m.end(2):]
        if new != text:
            p.write_text(new)
            changed.append(name)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check; exit 1 when a block is stale")
    args = ap.parse_args(argv)
    if args.check:
        stale = check()
        for name in stale:
            print(f"stale: {BLOCKS[name][0]} block {name!r} (run python scripts/docgen.py)", file=sys.stderr)
        return 1 if stale else 0
    print("rewrote: " + (", ".join(write()) or "nothing (all current)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
