"""Megatron teachers from HF folders (``TeacherSpec.hf_path`` / an HF ``checkpoint``), and the
pre-flight fingerprints read by the same config reader as the loader."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_distill.testing import assert_close
from mopd.config import DivergenceConfig, MOPDConfig, RoutingSpec, TeacherSpec
from mopd.preflight import fingerprint_hf, run_preflight
from mopd.routing import score_routed
from mopd.teachers import TeacherState
from tests.mopd.mopd_helpers import reference_logp, tiny_qwen3, token_batch


@pytest.mark.timeout(180)
@pytest.mark.parametrize("divisible_by,tree", [(1, False), (64, False), (64, True)],
                         ids=["unpadded", "padded", "padded-tree"])
def test_megatron_teachers_from_hf_folders_match_transformers(cpu_megatron, tmp_path, divisible_by, tree):
    """The teachers' log-probs are the HF models' (vocab 48). ``padded``: Megatron pads the
    vocabulary to 64 and loads the 16 extra output rows as zeros (logit 0): the teacher leaves
    them out of the softmax (the HF folder's ``vocab_size``), on the plain and the tree path."""
    from mcore_distill.hf import megatron_model_from_hf
    from mopd.config import TeacherTreeConfig
    from mopd.megatron import MegatronTeacherHost, build_teacher_pool

    hf_a, hf_b = tiny_qwen3(1, layers=2), tiny_qwen3(2, layers=2)
    hf_a.save_pretrained(tmp_path / "a")
    hf_b.save_pretrained(tmp_path / "b")
    host = MegatronTeacherHost(megatron_model_from_hf(tmp_path / "a", make_vocab_size_divisible_by=divisible_by),
                               micro_batch_size=2)
    assert host.chunks[0].vocab_size == (48 if divisible_by == 1 else 64)
    with torch.no_grad():
        for p in host.chunks[0].parameters():
            p.zero_()  # the host's own weights must not matter
    cfg = MOPDConfig(teachers={"a": TeacherSpec(hf_path=str(tmp_path / "a")),
                               "b": TeacherSpec(checkpoint=str(tmp_path / "b"), hf_path=str(tmp_path / "b"))},
                     routing=RoutingSpec(routes={"ra": {"a": 1.0}, "rb": {"b": 1.0}, "mix": {"a": 0.5, "b": 0.5}}),
                     rollout_temperature=0.8, divergence=DivergenceConfig(temperature=0.8),
                     teacher_tree=TeacherTreeConfig(enabled=tree, backend="dense"))
    pool = build_teacher_pool(cfg, host=host)
    batch = token_batch(4, 12, vocab=48, seed=4, score_from=True)
    ref_a, ref_b = reference_logp(hf_a, batch, 0.8), reference_logp(hf_b, batch, 0.8)
    for _ in range(2):  # second round: b resident first, then a comes back by onload
        targets, _ = score_routed(pool, batch, ["ra", "rb", "mix", "ra"], cfg.routing, dtype=torch.float64)
        expect = torch.stack([ref_a[0], ref_b[1], 0.5 * (ref_a[2] + ref_b[2]), ref_a[3]])
        assert_close("S", expect, targets.logp_sum, atol=2e-5, rtol=1e-5)
    assert pool.states() == {"a": TeacherState.RESIDENT, "b": TeacherState.OFFLOADED}
    pool.close()


def _folder(root, name, cfg: dict):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    return str(d)


def test_preflight_reads_configs_like_the_loader(tmp_path):
    new = tiny_qwen3(0).config.to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=new["rope_parameters"]["rope_theta"], rope_scaling=None, torch_dtype="bfloat16")
    a, b = _folder(tmp_path, "new", new), _folder(tmp_path, "old", old)
    assert fingerprint_hf(a).architecture == fingerprint_hf(b).architecture  # one model, two spellings
    assert fingerprint_hf(a).unsupported is None
    llama = _folder(tmp_path, "llama", {**new, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert "model_type='llama'" in fingerprint_hf(llama).unsupported
    cfg = MOPDConfig(teachers={"m": TeacherSpec(hf_path=llama), "h": TeacherSpec(backend="http", url="http://x:1",
                                                                                  hf_path=llama)},
                     routing=RoutingSpec(routes={"r": {"m": 1.0, "h": 1.0}}), student_hf_path=a)
    problems = "\n".join(run_preflight(cfg).problems)
    assert "teacher 'm': its weights are the HF folder" in problems and "model_type='llama'" in problems
    assert "teacher 'h': its weights" not in problems  # an HTTP teacher's architecture is the server's business
