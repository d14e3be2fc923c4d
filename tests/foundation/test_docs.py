"""The docs cannot drift from the code: the generated config reference is current, and no doc names
a module, function, class or file that does not exist (scripts/check_doc_refs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_reference_is_generated_from_the_current_docstrings():
    docgen = _script("docgen")
    assert docgen.check("config") == [], "docs/config.md is stale: run python scripts/docgen.py"
    text = (ROOT / "docs" / "config.md").read_text()
    for cls in ("MOPDConfig", "TeacherSpec", "RoutingSpec", "StagedOptimizerConfig", "PlannerConfig"):
        assert f"### `{cls}`" in text
    from mopd.config import TeacherSpec

    docs = docgen.field_docs(TeacherSpec)
    assert docs["max_retries"].startswith("Retries after a failed attempt") and set(docs) == {
        f for f in TeacherSpec.__dataclass_fields__}


@pytest.mark.timeout(300)
def test_docs_name_only_what_exists():
    problems = _script("check_doc_refs").dangling()
    assert problems == [], "dangling references in docs:\n" + "\n".join(problems)


def test_the_reference_checker_catches_what_is_gone():
    refs = _script("check_doc_refs")
    assert refs.check_dotted("harts.megatron.tree_forward") is None
    assert refs.check_dotted("mopd.config.TeacherSpec.max_retries") is None  # a dataclass field
    assert refs.check_dotted("harts.megatron.tree_forwardd") == "harts.megatron has no attribute 'tree_forwardd'"
    assert refs.check_dotted("mopd.no_such_module.f") == "mopd has no attribute 'no_such_module'"
    assert refs.check_path("examples/demo/config.py:DemoConfig") is None
    assert refs.check_path("examples/demo/config.py:NoSuchConfig") == "examples/demo/config.py defines no 'NoSuchConfig'"
    assert refs.check_path("examples/mopd/distill_tiny.py") == "no file examples/mopd/distill_tiny.py"
    assert refs.check_path("Megatron-LM/examples/run_simple_mcore_train_loop.py") is None  # another repository
    found = refs._code_refs("python -m mopd.preflightt cfg.yaml; make demo DEMO_ARGS='mopd.steps=3'")
    assert found == [("python -m mopd.preflightt", "no module 'mopd.preflightt'"),
                     ("mopd.preflightt", "mopd has no attribute 'preflightt'")]


def test_the_reference_checker_reads_imports_from_our_packages():
    """A doc's ``from pkg import Name`` must name something the package exports (a name that left a
    package's ``__init__`` is imported from its module); other projects' imports are not checked."""
    refs = _script("check_doc_refs")
    found = refs._code_refs("from harts import (plan_tree_batch,\n    grpo_groups as groups)\n"
                            "from harts.workload import grpo_groups\nfrom torch import nn\n")
    assert found[:3] == [("from harts import plan_tree_batch", None),
                         ("from harts import grpo_groups", "harts has no attribute 'grpo_groups'"),
                         ("from harts.workload import grpo_groups", None)]
    assert not any("torch" in ref for ref, _ in found)


def test_the_reference_checker_checks_anchors(tmp_path):
    """A link's ``#anchor`` must be a heading of the target file, slugged as GitHub does (en dash,
    parentheses, ``#``, commas and code ticks dropped; a repeated heading gets ``-1``)."""
    refs = _script("check_doc_refs")
    assert refs._slug("Model section at Qwen3-Next widths, 2026-12-02 03:58–04:05 UTC (issue #22, item 5)") == \
        "model-section-at-qwen3-next-widths-2026-12-02-03580405-utc-issue-22-item-5"
    assert refs._slug("harts (`bench/harts.py`), ρ = 0.75 [link](x.md)") == "harts-benchhartspy-ρ--075-link"
    md = tmp_path / "a.md"
    md.write_text("# Title\n\n## Runs\n\n```\n# not a heading\n```\n\n## Runs\n")
    assert refs.anchors(md) == {"title", "runs", "runs-1"}
