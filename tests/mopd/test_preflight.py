"""Fingerprints, compatibility rules and the --dry-run CLI on real HF model folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mopd.config import MOPDConfig, RoutingSpec, TeacherSpec
from mopd.errors import FingerprintMismatchError
from mopd.preflight import fingerprint_hf, main, run_preflight

VOCAB = {f"tok{i}": i for i in range(48)}


def _model_dir(root: Path, name: str, *, hidden: int = 32, vocab: dict | None = None, added: dict | None = None) -> str:
    from transformers import Qwen3Config

    d = root / name
    d.mkdir()
    Qwen3Config(vocab_size=48, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, architectures=["Qwen3ForCausalLM"]).save_pretrained(d)
    (d / "vocab.json").write_text(json.dumps(vocab or VOCAB))
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added or {"47": {"content": "<eos>"}}}))
    return str(d)


def test_fingerprint_ignores_non_architecture_keys(tmp_path):
    a = _model_dir(tmp_path, "a")
    cfg = json.loads((Path(a) / "config.json").read_text())
    cfg.update(_name_or_path="elsewhere", transformers_version="0.0", use_cache=False, dtype="bfloat16")
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text(json.dumps(cfg))
    (b / "vocab.json").write_text((Path(a) / "vocab.json").read_text())
    (b / "tokenizer_config.json").write_text((Path(a) / "tokenizer_config.json").read_text())
    fa, fb = fingerprint_hf(a), fingerprint_hf(b)
    assert (fa.architecture, fa.vocab, fa.added_tokens) == (fb.architecture, fb.vocab, fb.added_tokens)
    cfg["num_hidden_layers"] = 2
    (b / "config.json").write_text(json.dumps(cfg))
    assert fingerprint_hf(a).architecture != fingerprint_hf(b).architecture
    with pytest.raises(FingerprintMismatchError, match="no config.json"):
        fingerprint_hf(tmp_path)


def _config(student, teachers: dict, routes: dict) -> MOPDConfig:
    return MOPDConfig(teachers={t: TeacherSpec(**s) for t, s in teachers.items()},
                      routing=RoutingSpec(routes=routes), student_hf_path=student)


def test_compatibility_rules(tmp_path):
    student = _model_dir(tmp_path, "student", hidden=16)
    big = _model_dir(tmp_path, "big", hidden=64)
    ok = _model_dir(tmp_path, "ok")
    other_vocab = _model_dir(tmp_path, "ov", vocab={**VOCAB, "tok0": 99})
    other_added = _model_dir(tmp_path, "oa", added={"47": {"content": "<end>"}})
    cfg = _config(student, {"m": {"checkpoint": "/ck/m", "hf_path": ok},
                            "h": {"backend": "http", "url": "http://x:1", "hf_path": big}}, {"r": {"m": 1.0, "h": 1.0}})
    rep = run_preflight(cfg, tp=2, pp=2, world_size=8)
    assert rep.ok, rep.text()
    text = rep.text()
    assert "route 'r' -> h: w=1 (ŵ=0.500), m: w=1 (ŵ=0.500)" in text and "tp=2 pp=2 dp=2" in text
    cfg = _config(student, {"a": {"checkpoint": "/a", "hf_path": other_vocab}, "b": {"checkpoint": "/b", "hf_path": big},
                            "c": {"checkpoint": "/c", "hf_path": other_added}}, {"r": {"a": 1.0, "b": 1.0, "c": 1.0}})
    rep = run_preflight(cfg, tp=2, world_size=3)
    problems = "\n".join(rep.problems)
    assert "teacher 'a': vocabulary differs" in problems and "teacher 'c': added tokens differ" in problems
    assert "megatron teachers must share one architecture" in problems
    assert "world_size=3 is not divisible by tp*pp=2" in problems
    with pytest.raises(FingerprintMismatchError, match="pre-flight failed"):
        rep.raise_if_failed()


def test_dry_run_cli(tmp_path, capsys):
    student = _model_dir(tmp_path, "student")
    teacher = _model_dir(tmp_path, "teacher", hidden=64)
    bad = _model_dir(tmp_path, "bad", vocab={"x": 0})
    yaml = tmp_path / "mopd.yaml"
    yaml.write_text(
        f"student_hf_path: {student}\nrouting:\n  field: task_type\n  routes:\n    math: {{t: 1.0}}\n"
        f"teachers:\n  t: {{backend: http, url: 'http://127.0.0.1:9', hf_path: {teacher}}}\n"
        f"  unused: {{checkpoint: /nowhere, hf_path: {bad}}}\n")
    assert main([str(yaml), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "teacher 'unused'" in out and "[unused (never loaded)]" in out and out.strip().endswith("OK")
    assert main([str(yaml), "teachers.t.hf_path=" + bad, "--dry-run"]) == 1
    assert "teacher 't': vocabulary differs" in capsys.readouterr().out
    assert main([str(yaml), "routing.routes.math.ghost=1.0", "--dry-run"]) == 2
    assert "unknown teachers ['ghost']" in capsys.readouterr().err
    # the real entry point, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "mopd.preflight", str(yaml), "loss.is_cap=0", "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and "loss.is_cap must be > 0" in proc.stderr
