"""MOPDConfig as a Hydra structured config; validation errors name field and value; light import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mopd.config import MOPDConfig, TeacherSpec
from mopd.errors import ConfigError

BASE = ["teachers.math.checkpoint=/ck/math", "teachers.code.backend=http", "teachers.code.url=http://h:1",
        "routing.routes.m.math=1.0", "routing.routes.mix.math=0.5", "routing.routes.mix.code=0.5"]


def _compose(extra=()):
    from mcore_distill.structured import to_dataclass

    return to_dataclass(OmegaConf.from_dotlist(BASE + list(extra)), MOPDConfig, error=ConfigError)


def test_structured_config_round_trip():
    cfg = _compose(["loss.is_cap=3.0", "loss.aggregation=arithmetic", "rollout_temperature=0.7",
                    "divergence.temperature=0.7", "teachers.code.server_scales_temperature=true",
                    "teachers.code.vocab_size=151936", "teacher_tree.enabled=true", "teacher_tree.backend=varlen",
                    "teacher_tree.token_cap=4096"])
    assert isinstance(cfg, MOPDConfig) and isinstance(cfg.teachers["code"], TeacherSpec)
    assert cfg.teachers["code"].vocab_size == 151936
    assert (cfg.teacher_tree.enabled, cfg.teacher_tree.backend, cfg.teacher_tree.token_cap) == (True, "varlen", 4096)
    assert cfg.loss.is_cap == 3.0 and cfg.loss.aggregation == "arithmetic"
    assert cfg.routing.routes["mix"] == {"math": 0.5, "code": 0.5}


def test_hydra_config_store_compose(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="mopd_test_schema", node=MOPDConfig)
    (tmp_path / "train.yaml").write_text(
        "defaults:\n  - mopd_test_schema\n  - _self_\n"
        "teachers:\n  math: {checkpoint: /ck/math}\n  code: {backend: http, url: 'http://h:1'}\n"
        "routing:\n  routes:\n    m: {math: 1.0}\n    mix: {math: 0.5, code: 0.5}\n")
    with initialize_config_dir(version_base=None, config_dir=str(tmp_path)):
        cfg = compose(config_name="train", overrides=["loss.adv_clip=2.0", "routing.routes.mix.code=0.25"])
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, MOPDConfig) and isinstance(obj.teachers["math"], TeacherSpec)
    assert obj.loss.adv_clip == 2.0 and obj.routing.routes["mix"] == {"math": 0.5, "code": 0.25}
    assert obj.routing.teacher_ids() == ["code", "math"]


@pytest.mark.parametrize("extra,match", [
    (["routing.routes.m.ghost=1.0"], r"unknown teachers \['ghost'\]"),
    (["teachers.actor.checkpoint=/x"], "reserved"),
    (["divergence.temperature=0.5"], "teachers must score at the rollout temperature"),
    (["teachers.code.url=null"], "teacher.url is required"),
    (["rollout_temperature=0.7", "divergence.temperature=0.7"], "needs server_scales_temperature=True"),
    (["teachers.math.max_retries=-1"], "teacher.max_retries"),
    (["pool.wait_timeout_s=0"], "pool.wait_timeout_s"),
    (["teachers.code.timeout_s=-1"], "teacher.timeout_s"),
    (["teachers.code.max_batch=0"], "teacher.max_batch"),
    (["loss.rl_coef=0", "loss.distill_coef=0"], "both 0"),
    (["teachers.code.vocab_size=0"], "teacher.vocab_size"),
    (["teacher_tree.backend=sdpa"], "teacher_tree.backend"),
    (["teacher_tree.align=100"], "teacher_tree.align=100 must divide"),
])
def test_bad_values_raise_typed_errors(extra, match):
    with pytest.raises(ConfigError, match=match):
        _compose(extra)


def test_import_is_light():
    code = "import sys, mopd; bad = [m for m in ('megatron.core', 'sglang', 'transformer_engine') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
