"""``bench._common.source_digest``: the code a benchmark result came from, without git."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench._common import SOURCE_DIRS, machine_header, source_digest

ROOT = Path(__file__).resolve().parents[2]


def test_digest_names_the_sources(tmp_path):
    for d in SOURCE_DIRS:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "README.md").write_text("not a source")  # outside the digest
    first = source_digest(tmp_path)
    assert first == source_digest(ROOT) and len(first) == 12
    f = tmp_path / "optim_staged" / "adamw.py"
    f.write_text(f.read_text() + "\n# changed\n")
    assert source_digest(tmp_path) != first
    f.rename(tmp_path / "optim_staged" / "adamw2.py")  # same bytes, other name
    assert source_digest(tmp_path) not in (first, source_digest(ROOT))
    assert machine_header()["source_digest"] == first
