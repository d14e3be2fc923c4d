"""mcore_distill.atomic: atomic files, and a directory switch that survives kill -9 at every step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mcore_distill import atomic


def _write_dir(path: Path, tag: str, n: int = 3) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (path / f"shard{i}.bin").write_bytes(f"{tag}-{i}".encode() * 1000)


def _read_tag(path: Path) -> str:
    tags = {(path / f"shard{i}.bin").read_bytes()[:5].decode().split("-")[0] for i in range(3)}
    assert len(tags) == 1, f"{path} mixes copies: {tags}"
    assert sorted(p.name for p in path.iterdir()) == [f"shard{i}.bin" for i in range(3)]
    return tags.pop()


def test_atomic_write_replaces_whole_file_or_nothing(tmp_path):
    p = tmp_path / "a.json"
    atomic.atomic_write_json(p, {"x": 1})
    assert p.read_text().strip().startswith("{")
    with pytest.raises(RuntimeError), atomic.atomic_write(p, "w") as f:
        f.write("partial")
        raise RuntimeError("crash while writing")
    assert '"x": 1' in p.read_text()
    assert [q.name for q in tmp_path.iterdir()] == ["a.json"], "temporary left behind"


def test_atomic_torch_save_roundtrip(tmp_path):
    import torch

    atomic.atomic_torch_save({"w": torch.arange(4)}, tmp_path / "s.pt")
    assert torch.equal(torch.load(tmp_path / "s.pt")["w"], torch.arange(4))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_publish_directory_replaces_and_cleans(tmp_path, exchange):
    final = tmp_path / "ckpt"
    for tag in ("old", "new"):
        tmp = atomic.temp_directory_for(final)
        _write_dir(tmp, tag)
        atomic.publish_directory(tmp, final, exchange=exchange)
        assert _read_tag(final) == tag
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


_CHILD = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from mcore_distill import atomic

    final, kill_at, exchange = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    calls = [0]

    def step(fn):
        def wrapped(*a, **k):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return wrapped

    atomic.os.replace = step(os.replace)
    atomic.os.rename = step(os.rename)
    atomic._exchange = step(atomic._exchange)
    atomic.shutil.rmtree = step(shutil.rmtree)
    tmp = atomic.temp_directory_for(final)
    for i in range(3):
        (tmp / f"shard{i}.bin").write_bytes(f"new-{i}".encode() * 1000)
    atomic.publish_directory(tmp, final, exchange=exchange)
    print("steps", calls[0])
""")


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_publish_directory_survives_kill9_at_every_step(tmp_path, exchange):
    """SIGKILL the writer before each rename/exchange/delete of the switch: afterwards
    recover_directory always yields a complete copy (old before the switch point, new after), and
    remove_stale leaves nothing but that copy."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(atomic.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    _write_dir(tmp_path / "probe", "old")
    full = subprocess.run([sys.executable, str(script), str(tmp_path / "probe"), "0", str(int(exchange))],
                          env=env, capture_output=True, text=True, timeout=60)
    steps = int(full.stdout.split()[-1])
    assert steps >= 4  # tmp->ready, switch (1-2 renames), old->delete
    seen = set()
    for kill_at in range(1, steps + 1):
        final = tmp_path / f"ck{kill_at}"
        _write_dir(final, "old")
        r = subprocess.run([sys.executable, str(script), str(final), str(kill_at), str(int(exchange))],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == -signal.SIGKILL, r.stderr
        got = atomic.recover_directory(final)
        assert got == final, f"kill at step {kill_at}: no directory recovered"
        seen.add(_read_tag(final))
        atomic.remove_stale(final)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(final.name + ".") or p.name == final.name) == [final.name]
    assert seen == {"old", "new"}, seen


def test_remove_stale_keeps_live_writers(tmp_path):
    final = tmp_path / "ckpt"
    _write_dir(final, "old")
    live = atomic.temp_directory_for(final)  # token names this (live) process
    dead = atomic.temp_directory_for(final, token="1-otherhost-12345")
    assert atomic.remove_stale(final) == [dead]
    assert live.exists() and not dead.exists()
    assert atomic.remove_stale(final, keep_alive=False) == [live]
