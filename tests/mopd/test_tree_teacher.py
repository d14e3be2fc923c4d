"""Megatron teacher scoring harts tree batches (prefix forest → compact row → tree attention →
harts chunked LM head → per-row log-probs by index) vs plain padded scoring, fp64 on CPU."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, seed_all
from mopd.backends import TokenBatch
from mopd.config import MOPDConfig, RoutingSpec, TeacherPoolConfig, TeacherSpec, TeacherTreeConfig
from mopd.errors import ConfigError

V, L = 64, 12
CFG = TinyGPTConfig(vocab_size=V, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=64, max_sequence_length=32, params_dtype=torch.float64)


def _gpt(seed: int):
    seed_all(seed)
    model = build_tiny_gpt(CFG)
    with torch.no_grad():
        model.output_layer.weight.mul_(30.0)  # peaked distributions: log-probs far from uniform
    return model


def _forest_batch() -> TokenBatch:
    """Right-padded rows forming a forest with a GRPO fork (rows 0-2 share a 5-token prompt),
    duplicates (rows 3 and 4 repeat rows 0 and 1), a prefix of another row (row 5 = row 0[:7]),
    a fork at the first token (row 6 shares only token 10), an unrelated row and a one-token row."""
    prompt = [10, 11, 12, 13, 14]
    rows = [prompt + [20, 21, 22, 23, 24, 25, 26], prompt + [30, 31, 32], prompt + [20, 21, 40, 41, 42],
            None, None, None, [10, 50, 51, 52, 53, 54], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8], [9]]
    rows[3], rows[4], rows[5] = list(rows[0]), list(rows[1]), rows[0][:7]
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    score_from = torch.tensor([4, 4, 4, 0, 2, 1, 0, 3, 0])
    return TokenBatch(ids, lengths, score_from)


def _plain_reference(model, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """The unpacked teacher: each row alone, unpadded, through the same Megatron model, fp64."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for b in range(batch.input_ids.shape[0]):
            n = int(batch.lengths[b])
            row = batch.input_ids[b, :n]
            logits = model(row[None], torch.arange(n)[None], None)[0].double()
            lp = torch.log_softmax(logits / temperature, -1)[:-1].gather(-1, row[1:, None])[:, 0]
            out[b, : n - 1] = lp
    return torch.where(batch.label_mask(), out, torch.zeros_like(out))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tree", [
    TeacherTreeConfig(enabled=True, backend="dense", chunk_size=5, token_cap=64, align=1, fallback_compression=1.0),
    TeacherTreeConfig(enabled=True, backend="dense", chunk_size=1024, token_cap=24, align=4, fallback_compression=1.3),
    TeacherTreeConfig(enabled=True, backend="flex", chunk_size=7, token_cap=64, align=8, fallback_compression=1.0),
], ids=["one-tree", "split+thd-fallback", "flex-forward"])
def test_tree_scored_teacher_equals_plain_teacher_fp64(cpu_megatron, tmp_path, tree):
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint

    teacher = _gpt(1)
    save_teacher_checkpoint(teacher, str(tmp_path / "t"))
    host = MegatronTeacherHost(_gpt(2), micro_batch_size=4)
    plain = MegatronTeacher("plain", host, str(tmp_path / "t"), temperature=0.8)
    tree_t = MegatronTeacher("tree", host, str(tmp_path / "t"), temperature=0.8, tree=tree)
    batch = _forest_batch()
    plain.load()
    lp_plain = plain.score(batch)
    tree_t.load()  # same weights, written again in place under the other owner
    lp_tree = tree_t.score(batch)
    ref = _plain_reference(teacher, batch, 0.8)
    assert lp_tree.dtype == torch.float64 and lp_plain.dtype == torch.float32  # Megatron's CE kernel is fp32
    mask = batch.label_mask()
    assert ref[mask].abs().min() > 0 and ref[mask].abs().mean() > 0.5  # every label scored, non-trivial
    assert_close("tree vs unpacked rows", ref, lp_tree, atol=1e-10, rtol=1e-10)
    assert_close("plain (fp32 CE) vs unpacked rows", ref, lp_plain.double(), atol=2e-5, rtol=1e-6)
    assert torch.equal(lp_tree != 0, mask)
    st = tree_t.last_tree_stats
    assert st["tokens"] == float(batch.lengths.sum())
    if tree.fallback_compression <= 1.0:  # everything ran as trees: shared prefixes computed once
        assert st["rows"] < st["tokens"] and st["micro_batches"] == 1 and st["compression"] > 1.3
    else:
        assert st["micro_batches"] >= 2
    # plain batches still run unchanged on the tree-enabled host
    plain.load()
    assert_close("plain after tree", lp_plain, plain.score(batch), atol=0, rtol=0)


def test_tree_config_reaches_the_teacher_and_validates(cpu_megatron, tmp_path):
    import dataclasses

    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, build_teacher_pool

    assert {f.name for f in dataclasses.fields(TeacherTreeConfig)} == {
        "enabled", "backend", "chunk_size", "token_cap", "align", "fallback_compression"}, "cover the new field"
    tree = TeacherTreeConfig(enabled=True, backend="varlen", chunk_size=3, token_cap=96, align=32,
                             fallback_compression=2.5)
    cfg = MOPDConfig(teachers={"m": TeacherSpec(checkpoint=str(tmp_path / "m"))},
                     routing=RoutingSpec(routes={"r": {"m": 1.0}}), teacher_tree=tree)
    pool = build_teacher_pool(cfg, host=MegatronTeacherHost(_gpt(3)))
    assert pool._backends["m"].tree is tree
    pool.close()
    off = dataclasses.replace(tree, enabled=False)
    assert MegatronTeacher("m", MegatronTeacherHost(_gpt(3)), "x", tree=off).tree is None
    with pytest.raises(ValueError, match="logprob_fn and an enabled tree config"):
        MegatronTeacher("m", MegatronTeacherHost(_gpt(3)), "x", tree=tree, logprob_fn=lambda o, m: o)
    for kw, msg in [({"backend": "tri"}, "teacher_tree.backend must be one of"),
                    ({"token_cap": 100, "align": 32}, "teacher_tree.align=32 must divide"),
                    ({"chunk_size": 0}, "teacher_tree.chunk_size must be a positive int"),
                    ({"fallback_compression": -1.0}, "teacher_tree.fallback_compression must be >= 0")]:
        with pytest.raises(ConfigError, match=msg):
            TeacherTreeConfig(**kw)


@pytest.mark.timeout(120)
def test_tree_scoring_through_the_pool_each_knob_changes_the_plan(cpu_megatron, tmp_path):
    """Every TeacherTreeConfig value reaches the scoring path: token_cap/align/fallback change
    the micro-batch plan, chunk_size/backend the kernel, and the values stay equal."""
    import dataclasses

    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint
    from mopd.routing import score_routed
    from mopd.teachers import TeacherPool

    save_teacher_checkpoint(_gpt(1), str(tmp_path / "t"))
    host = MegatronTeacherHost(_gpt(2))
    batch = _forest_batch()
    base = TeacherTreeConfig(enabled=True, backend="dense", chunk_size=1024, token_cap=64, align=1,
                             fallback_compression=1.0)
    variants = {"base": base, "token_cap": dataclasses.replace(base, token_cap=24),
                "align": dataclasses.replace(base, align=16), "fallback": dataclasses.replace(base, fallback_compression=9.0),
                "chunk": dataclasses.replace(base, chunk_size=2), "backend": dataclasses.replace(base, backend="flex")}
    teachers = {k: MegatronTeacher(k, host, str(tmp_path / "t"), tree=v) for k, v in variants.items()}
    pool = TeacherPool(teachers, config=TeacherPoolConfig(prefetch=False))
    spec = RoutingSpec(routes={k: {k: 1.0} for k in variants})
    out, stats = {}, {}
    for k in variants:
        targets, _ = score_routed(pool, batch, [k] * batch.input_ids.shape[0], spec, dtype=torch.float64)
        out[k], stats[k] = targets.logp_sum, dict(teachers[k].last_tree_stats)
    pool.close()
    for k in variants:
        assert_close(f"{k} vs base", out["base"], out[k], atol=1e-10, rtol=1e-10)
    assert stats["token_cap"]["micro_batches"] > stats["base"]["micro_batches"] == 1
    assert stats["align"]["rows"] % 16 == 0 and stats["align"]["rows"] > stats["base"]["rows"]
    assert stats["fallback"]["rows"] == stats["fallback"]["tokens"] > stats["base"]["rows"]  # plain packing
