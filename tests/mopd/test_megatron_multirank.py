"""Megatron teacher under TP=2 and PP=2 (two spawned gloo ranks, one run for both layouts), plain
and harts tree scoring."""

from __future__ import annotations

import tempfile

import pytest
import torch

from mcore_distill.testing import (
    TinyGPTConfig,
    build_tiny_gpt,
    destroy_megatron,
    init_megatron,
    run_ranks,
    seed_all,
)

L, B = 10, 4


def _cfg(tp: int, pp: int) -> TinyGPTConfig:
    return TinyGPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=64, max_sequence_length=32, tensor_model_parallel_size=tp,
                         pipeline_model_parallel_size=pp)


def _batch(vocab: int = 64):
    from tests.mopd.mopd_helpers import token_batch

    return token_batch(B, L, vocab=vocab, seed=9, score_from=True)


def _score(tp: int, pp: int, folder: str):
    from mopd.config import TeacherPoolConfig, TeacherTreeConfig
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint
    from mopd.teachers import TeacherPool

    init_megatron(tp=tp, pp=pp, seed=11)
    teacher_model = build_tiny_gpt(_cfg(tp, pp))
    save_teacher_checkpoint(teacher_model, folder)
    seed_all(12)
    host = MegatronTeacherHost(build_tiny_gpt(_cfg(tp, pp)), micro_batch_size=2)
    # the same weights scored as harts tree batches (several variable-size micro-batches, so
    # PP pads them to one length; TP runs the vocab-parallel chunked head)
    tree = TeacherTreeConfig(enabled=True, backend="dense", chunk_size=3, token_cap=24, align=2,
                             fallback_compression=1.0)
    pool = TeacherPool({"t": MegatronTeacher("t", host, folder, temperature=0.9),
                        "tree": MegatronTeacher("tree", host, folder, temperature=0.9, tree=tree)},
                       config=TeacherPoolConfig())
    with pool.acquire("t") as lease:
        logp = lease.score(_batch()).take().clone()
    with pool.acquire("tree") as lease:
        logp_tree = lease.score(_batch()).take().clone()
    pool.close()
    tree_err = (logp_tree.double() - logp.double()).abs().max().item()
    if tp == 1:
        return teacher_model, logp, tree_err
    # a real vocabulary of 40 in the padded 64: rank 1's shard [32, 64) keeps 8 rows
    pool = TeacherPool({"t": MegatronTeacher("t", host, folder, temperature=0.9, vocab_size=40),
                        "tree": MegatronTeacher("tree", host, folder, temperature=0.9, tree=tree, vocab_size=40)},
                       config=TeacherPoolConfig())
    cut = []
    for tid in ("t", "tree"):
        with pool.acquire(tid) as lease:
            cut.append(lease.score(_batch(40)).take().clone())
    pool.close()
    return teacher_model, logp, tree_err, cut


def _tp_case(rank: int, folder: str):
    """TP=2: teacher log-probs vs log_softmax of the TP-gathered full logits (fp64)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    model, logp, tree_err, cut = _score(2, 1, folder)

    def reference(batch, vocab: int):
        with torch.no_grad():
            shard = model(batch.input_ids, torch.arange(L).expand(B, L), None)
            full = gather_from_tensor_model_parallel_region(shard)
        labels = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, -1:]], 1)
        ref = torch.log_softmax(full[..., :vocab].double() / 0.9, -1).gather(-1, labels[..., None])[..., 0]
        return torch.where(batch.label_mask(), ref, torch.zeros_like(ref)), full.shape[-1], shard.shape[-1]

    ref, vocab, vocab_shard = reference(_batch(), 64)
    ref40, _, _ = reference(_batch(40), 40)
    cut_err = max((c.double() - ref40).abs().max().item() for c in cut)
    destroy_megatron()
    return (logp.double() - ref).abs().max().item(), vocab, vocab_shard, tree_err, cut_err


def _pp_case(rank: int, folder: str):
    """PP=2: last-stage log-probs vs a transformers Qwen3 holding the gathered full weights."""
    from mopd.hf_weights import QwenShape, hf_qwen3_config, megatron_to_hf_qwen3
    from tests.mopd.mopd_helpers import reference_logp

    model, logp, tree_err = _score(1, 2, folder)
    local = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    offset = rank * 1  # one layer per stage
    renamed = {}
    for k, v in local.items():
        if k.startswith("decoder.layers."):
            i, rest = k[len("decoder.layers."):].split(".", 1)
            k = f"decoder.layers.{int(i) + offset}.{rest}"
        renamed[k] = v
    parts = [None, None]
    torch.distributed.all_gather_object(parts, renamed)
    destroy_megatron()
    if rank == 0:
        return None, float(logp.abs().sum()), tree_err
    full = {k: v for p in parts for k, v in p.items()}
    from transformers import Qwen3ForCausalLM

    shape = QwenShape(num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=8)
    hf = Qwen3ForCausalLM(hf_qwen3_config(vocab_size=64, hidden_size=32, ffn_hidden_size=64, shape=shape,
                                          max_position_embeddings=32))
    hf.load_state_dict(megatron_to_hf_qwen3(full, shape), strict=True)
    ref = reference_logp(hf.eval(), _batch(), 0.9)
    return (logp.double() - ref).abs().max().item(), float(ref.abs().sum()), tree_err


def _both(rank: int, world_size: int, folder_tp: str, folder_pp: str):
    return _tp_case(rank, folder_tp), _pp_case(rank, folder_pp)


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_megatron_teacher_tp2_and_pp2():
    with tempfile.TemporaryDirectory() as d:
        results = run_ranks(_both, 2, f"{d}/tp", f"{d}/pp", timeout=200)
    for rank, ((tp_err, vocab, vocab_shard, tp_tree_err, cut_err), (pp_err, mass, pp_tree_err)) in enumerate(results):
        assert vocab == 64 and vocab_shard == 32  # really vocab-parallel
        # vocab_size=40 < 64: the padded rows leave the softmax on both ranks' shards, plain and tree
        assert cut_err < 2e-5, f"rank {rank}: vocab_size=40 log-probs off by {cut_err}"
        assert tp_err < 2e-5, f"rank {rank}: TP=2 teacher log-probs off by {tp_err}"
        # fp32 model: tree vs plain scoring agree to float reduction order
        assert tp_tree_err < 2e-5 and pp_tree_err < 2e-5, f"rank {rank}: tree scoring off by {tp_tree_err}, {pp_tree_err}"
        if rank == 0:
            assert mass == 0.0  # first stage has no log-probs
        else:
            assert mass > 1.0 and pp_err < 2e-5, f"PP=2 last stage off by {pp_err}"
