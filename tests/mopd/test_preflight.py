"""Fingerprints, compatibility rules, checkpoint checks and the CLI (full checks, --dry-run, misspelled
keys) on real HF model folders and checkpoint folders."""

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


def _checkpoint(root: Path, name: str, *, kind: str = "dist") -> str:
    """A folder that looks like a loadable teacher checkpoint (dist_checkpointing or teacher shards)."""
    d = root / name
    d.mkdir()
    (d / ("metadata.json" if kind == "dist" else "shard_tp0of1-pp0of1.pt")).write_text("{}")
    return str(d)


def test_compatibility_rules(tmp_path):
    student = _model_dir(tmp_path, "student", hidden=16)
    big = _model_dir(tmp_path, "big", hidden=64)
    ok = _model_dir(tmp_path, "ok")
    other_vocab = _model_dir(tmp_path, "ov", vocab={**VOCAB, "tok0": 99})
    other_added = _model_dir(tmp_path, "oa", added={"47": {"content": "<end>"}})
    cfg = _config(student, {"m": {"checkpoint": _checkpoint(tmp_path, "ck_m"), "hf_path": ok},
                            "h": {"backend": "http", "url": "http://x:1", "hf_path": big}}, {"r": {"m": 1.0, "h": 1.0}})
    rep = run_preflight(cfg, tp=2, pp=2, world_size=8)
    assert rep.ok, rep.text()
    text = rep.text()
    assert "route 'r' -> h: w=1 (ŵ=0.500), m: w=1 (ŵ=0.500)" in text and "tp=2 pp=2 dp=2" in text
    ck = {t: _checkpoint(tmp_path, f"ck_{t}", kind="shards") for t in "abc"}
    cfg = _config(student, {"a": {"checkpoint": ck["a"], "hf_path": other_vocab}, "b": {"checkpoint": ck["b"], "hf_path": big},
                            "c": {"checkpoint": ck["c"], "hf_path": other_added}}, {"r": {"a": 1.0, "b": 1.0, "c": 1.0}})
    rep = run_preflight(cfg, tp=2, world_size=3)
    problems = "\n".join(rep.problems)
    assert "teacher 'a': vocabulary differs" in problems and "teacher 'c': added tokens differ" in problems
    assert "megatron teachers must share one architecture" in problems
    assert "world_size=3 is not divisible by tp*pp=2" in problems
    with pytest.raises(FingerprintMismatchError, match="pre-flight failed"):
        rep.raise_if_failed()


def test_checkpoint_paths_exist_and_are_readable(tmp_path):
    """Used Megatron teachers' checkpoints: missing, a file, empty, unreadable, not set; unused
    teachers and HTTP teachers are not checked."""
    import os

    student = _model_dir(tmp_path, "student")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "file").write_text("x")
    locked = _checkpoint(tmp_path, "locked")
    os.chmod(locked, 0)
    teachers = {"gone": {"checkpoint": str(tmp_path / "gone"), "hf_path": student},
                "file": {"checkpoint": str(tmp_path / "file"), "hf_path": student},
                "empty": {"checkpoint": str(empty), "hf_path": student},
                "locked": {"checkpoint": locked, "hf_path": student},
                "unset": {"hf_path": student},
                "good": {"checkpoint": _checkpoint(tmp_path, "good"), "hf_path": student},
                "idle": {"checkpoint": "/nowhere", "hf_path": student}}
    cfg = _config(student, teachers, {"r": {t: 1.0 for t in teachers if t != "idle"}})
    try:
        problems = "\n".join(run_preflight(cfg).problems)
    finally:
        os.chmod(locked, 0o700)
    assert f"teacher 'gone': checkpoint {str(tmp_path / 'gone')!r} does not exist" in problems
    assert "teacher 'file': checkpoint" in problems and "is not a folder" in problems
    assert "teacher 'empty': checkpoint" in problems and "holds no dist_checkpointing checkpoint" in problems
    if os.geteuid() != 0:  # root reads anything
        assert "teacher 'locked': checkpoint" in problems and "not readable" in problems
    # no checkpoint: the weights come from hf_path, here a folder with config.json but no safetensors
    assert f"teacher 'unset': checkpoint {student!r} holds no dist_checkpointing checkpoint" in problems
    assert "'good'" not in problems and "'idle'" not in problems


def test_cli_full_check_and_dry_run(tmp_path, capsys):
    student = _model_dir(tmp_path, "student")
    teacher = _model_dir(tmp_path, "teacher", hidden=64)
    bad = _model_dir(tmp_path, "bad", vocab={"x": 0})
    yaml = tmp_path / "mopd.yaml"
    yaml.write_text(
        f"student_hf_path: {student}\nrouting:\n  field: task_type\n  routes:\n    math: {{t: 1.0}}\n"
        f"teachers:\n  t: {{backend: http, url: 'http://127.0.0.1:9', hf_path: {teacher}}}\n"
        f"  unused: {{checkpoint: /nowhere, hf_path: {bad}}}\n")
    assert main([str(yaml)]) == 0
    out = capsys.readouterr().out
    assert "teacher 'unused'" in out and "[unused (never loaded)]" in out and out.strip().endswith("OK")
    assert main([str(yaml), "teachers.t.hf_path=" + bad]) == 1
    assert "teacher 't': vocabulary differs" in capsys.readouterr().out
    # --dry-run reads no model folder: the same mismatch passes, the resolved setup is printed
    assert main([str(yaml), "teachers.t.hf_path=" + bad, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "route 'math' -> t: w=1 (ŵ=1.000)" in out and "dry run: no checkpoint or model folder was read" in out
    assert "fingerprint" not in out
    assert main([str(yaml), "routing.routes.math.ghost=1.0", "--dry-run"]) == 2
    assert "unknown teachers ['ghost']" in capsys.readouterr().err
    # the real entry point, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "mopd.preflight", str(yaml), "loss.is_cap=0"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and "loss.is_cap must be > 0" in proc.stderr


@pytest.mark.parametrize("override,message", [
    ("loss.is_capp=3", "'loss.is_capp': MOPDLossConfig has no field 'is_capp' (did you mean 'is_cap'?); "
                       "valid keys: adv_clip, aggregation, check_finite, distill_coef, is_cap, "),
    ("teachers.t.urll=http://x", "'teachers.t.urll': TeacherSpec has no field 'urll' (did you mean 'url'?)"),
    ("rollout_temprature=0.5", "'rollout_temprature': MOPDConfig has no field 'rollout_temprature' "
                               "(did you mean 'rollout_temperature'?)"),
])
def test_misspelled_key_lists_the_valid_keys(tmp_path, capsys, override, message):
    yaml = tmp_path / "mopd.yaml"
    yaml.write_text("routing:\n  routes:\n    math: {t: 1.0}\nteachers:\n  t: {backend: http, url: 'http://h:1'}\n")
    assert main([str(yaml), override, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"invalid configuration: unknown config key in {yaml} + overrides: {message}" in err, err


def test_shipped_example_config_resolves(capsys):
    """examples/configs/mopd.yaml: two Megatron teachers, one HTTP teacher, a blended route."""
    root = Path(__file__).resolve().parents[2]
    from mopd.preflight import load_config

    cfg = load_config(str(root / "examples" / "configs" / "mopd.yaml"), [])
    assert {t: s.backend for t, s in cfg.teachers.items()} == {"math": "megatron", "code": "megatron", "chat": "http"}
    assert cfg.routing.routes["agent"] == {"code": 0.5, "chat": 0.5} and cfg.teacher_tree.enabled
    assert main([str(root / "examples" / "configs" / "mopd.yaml"), "--tp", "2", "--world-size", "8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "route 'agent' -> chat: w=0.5 (ŵ=0.500), code: w=0.5 (ŵ=0.500)" in out and "tp=2 pp=1 dp=4" in out
    # without --dry-run the missing folders of this template are reported, not crashed on
    assert main([str(root / "examples" / "configs" / "mopd.yaml")]) == 1
    assert "teacher 'math': checkpoint '/checkpoints/math-teacher' does not exist" in capsys.readouterr().out
