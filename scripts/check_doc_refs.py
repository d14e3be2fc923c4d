"""Fail when README.md or docs/*.md names a module, function, class or file that does not exist.

    python scripts/check_doc_refs.py        # prints every dangling reference; exit 1 if any

What is checked, in inline code spans and fenced blocks:

* dotted names rooted at one of this project's packages (``mopd.preflight``,
  ``harts.megatron.tree_forward``, ``examples.megatron_integration.train``, call parentheses
  dropped): the module must import and every further part must be an attribute (or a dataclass
  field);
* ``python -m NAME`` commands: ``NAME`` must be an importable module of this project;
* ``from MODULE import NAME, ...`` of this project's packages: each ``MODULE.NAME`` as above (a
  name a package no longer exports is caught here);
* paths whose first part is a top-level entry of this repository (``examples/demo/run.py``,
  ``docs/img/harts.png``, ``examples/demo/config.py:DemoConfig``): the file must exist (and define
  the name after ``:``); paths with placeholders (``<``, ``*``, ``{``, ``$``, ``...``) are skipped;
* relative Markdown links ``[text](path#anchor)``: the target file must exist, and an anchor into a
  Markdown file must be one of its headings' GitHub anchors (:func:`anchors`).

Paths under ``outputs/`` (written at run time) and other repositories' paths (which start with a
folder this repository does not have, e.g. ``Megatron-LM/examples/...``) are not checked.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mopd", "harts", "optim_staged", "colocate", "shared_teacher", "mcore_distill", "examples", "bench")
_SPAN = re.compile(r"``(.+?)``|`([^`\n]+)`")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
_RUN_MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
_FROM_IMPORT = re.compile(r"\bfrom\s+([A-Za-z_][\w.]*)\s+import\s+(\([^)]*\)|[\w, \t]+)")
_SKIP = ("<", "*", "{", "$", "...", " ", "…")
_FILE_NAME = re.compile(r"\.(py|md|json|yaml|yml|png|sh|toml|txt|csv|pt)$")  # harts.json is a file name


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: rendered text (link targets, code ticks, emphasis dropped),
    lowercased, characters other than letters, digits, ``_``, ``-`` and spaces removed, spaces → ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.lru_cache
def anchors(md: Path) -> frozenset[str]:
    """Every heading anchor of ``md`` (a repeated heading gets ``-1``, ``-2``, … as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    body = _FENCE.sub("", md.read_text())
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", body, re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _import(name: str):
    """The module ``name`` or None if it does not exist; a module that exists but needs a missing
    optional dependency (SGLang, TransformerEngine) counts as existing (returns ``...``)."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return ...


def check_dotted(name: str) -> str | None:
    """Why ``name`` (``pkg.module.attr...``) does not resolve, or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = _import(".".join(parts[:i]))
        if mod is None:
            continue
        if mod is ...:
            return None
        obj = mod
        for j, attr in enumerate(parts[i:], start=i):
            fields = getattr(obj, "__dataclass_fields__", {}) if dataclasses.is_dataclass(obj) else {}
            if attr in fields:
                return None  # a field: nothing below it is checked
            if not hasattr(obj, attr):
                sub = _import(".".join(parts[:j + 1]))
                if sub is None:
                    return f"{'.'.join(parts[:j])} has no attribute {attr!r}"
                if sub is ...:
                    return None
                obj = sub
                continue
            obj = getattr(obj, attr)
        return None
    return f"no module {parts[0]!r}"


def check_path(ref: str) -> str | None:
    """Why the repository path ``ref`` (``file`` or ``file:Name``) is dangling, or None; paths
    outside this repository's top-level entries are not checked."""
    path, _, name = ref.partition(":")
    path = path.rstrip("/")
    first = path.split("/")[0]
    if not first or not (ROOT / first).exists() or first == "outputs":
        return None
    if not (ROOT / path).exists():
        return f"no file {path}"
    if name:
        text = (ROOT / path).read_text()
        if not re.search(rf"(?m)^\s*(?:class|def)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", text):
            return f"{path} defines no {name!r}"
    return None


def _code_refs(code: str) -> list[tuple[str, str | None]]:
    """(reference, problem) for one code span or fenced block."""
    out = []
    for m in _RUN_MODULE.finditer(code):
        mod = m.group(1).rstrip(".")
        if mod.split(".")[0] in PACKAGES:
            out.append((f"python -m {mod}", None if _import(mod) is not None else f"no module {mod!r}"))
    for m in _FROM_IMPORT.finditer(code):
        mod = m.group(1)
        if mod.split(".")[0] in PACKAGES:
            for name in re.findall(r"([A-Za-z_]\w*)(?:\s+as\s+\w+)?", m.group(2)):
                out.append((f"from {mod} import {name}", check_dotted(f"{mod}.{name}")))
    keys = set(re.findall(r"\+?([\w.]+)=", code))  # Hydra / dotlist keys (mopd.steps=100), not Python names
    for token in re.split(r"[\s,;()\[\]=\"']+", code):
        token = token.strip("`.:+")
        if not token or any(s in token for s in _SKIP) or token in keys:
            continue
        if _DOTTED.match(token) and not _FILE_NAME.search(token):
            out.append((token, check_dotted(token)))
        elif "/" in token and not token.startswith(("/", "http", "./", "~")) and not re.match(r"^\w+://", token):
            if re.search(r"\.[A-Za-z]{1,5}(:\w+)?$", token) or token.endswith("/"):
                out.append((token, check_path(token)))
    return out


def dangling() -> list[str]:
    """``file:line: reference: why`` for every dangling reference in the docs."""
    problems = []
    for doc in doc_files():
        text = doc.read_text()
        spans = [(m.start(), m.group(1)) for m in _FENCE.finditer(text)]
        body = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets, fences blanked
        spans += [(m.start(), m.group(1) or m.group(2)) for m in _SPAN.finditer(body)]
        for pos, code in spans:
            for ref, why in _code_refs(code):
                if why:
                    problems.append(f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}: {ref}: {why}")
        for m in _LINK.finditer(body):
            target, _, anchor = m.group(1).partition("#")
            if re.match(r"^\w+:", target):
                continue
            line = text.count("\n", 0, m.start()) + 1
            path = (doc.parent / target) if target else doc
            if not path.exists():
                problems.append(f"{doc.relative_to(ROOT)}:{line}: link {m.group(1)}: no file {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{doc.relative_to(ROOT)}:{line}: link {m.group(1)}: no heading with anchor "
                                f"#{anchor} in {path.relative_to(ROOT)}")
    return problems


def main() -> int:
    problems = dangling()
    for p in problems:
        print(p)
    print(f"{len(problems)} dangling reference(s) in {len(doc_files())} files", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
