"""GPU lane: kernels on CUDA vs fp64 CPU references; Megatron teacher on CUDA vs transformers.

Run: ``python -m pytest -m gpu tests/mopd/test_mopd_gpu.py -q`` (H200: ~30 s).
"""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch

from mcore_distill.testing import (
    TinyGPTConfig,
    assert_close,
    build_tiny_gpt,
    free_port,
    init_megatron,
    seed_all,
)
from mopd import reference as ref
from mopd.config import DivergenceConfig, MOPDLossConfig, TeacherPoolConfig
from mopd.divergences import full_vocab_divergence, row_divergence, topk_divergence
from mopd.hf_weights import QwenShape, hf_qwen3_config, megatron_to_hf_qwen3
from mopd.objectives import TokenTargets, mopd_pg_loss
from mopd.teachers import TeacherPool
from tests.mopd.mopd_helpers import reference_logp, token_batch

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_megatron():
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    init_megatron(tp=1, pp=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd"])
def test_full_vocab_and_topk_on_cuda_vs_fp64(dtype, tol, kind):
    g = torch.Generator().manual_seed(0)
    N, V, k = 300, 32000, 64
    z = (2 * torch.randn(N, V, generator=g)).to(dtype)
    t = torch.log_softmax(2 * torch.randn(N, V, generator=g), -1).to(dtype)
    mask = torch.rand(N, generator=g) > 0.1
    cfg = DivergenceConfig(kind=kind, beta=0.3, temperature=0.8, chunk_rows=128)
    zc = z.cuda().requires_grad_(True)
    loss, _ = full_vocab_divergence(zc, t.cuda(), mask.cuda(), config=cfg)
    (g_out,) = torch.autograd.grad(loss, zc)
    # fp64 reference on the same (rounded) inputs, whole tensor at once
    z64 = z.double().requires_grad_(True)
    per_row = row_divergence(torch.log_softmax(z64 / 0.8, -1), torch.log_softmax(t.double(), -1), kind=kind, beta=0.3)
    expect = (per_row * mask).sum()
    (g_ref,) = torch.autograd.grad(expect, z64)
    assert_close("loss", expect.detach(), loss.double().cpu(), atol=0, rtol=tol if dtype == torch.float32 else 1e-2)
    assert_close("grad", g_ref.to(dtype).double(), g_out.double().cpu(), atol=1e-6 if dtype == torch.float32 else 1e-4,
                 rtol=1e-3 if dtype == torch.float32 else 2e-2)
    t_vals, ids = t.float().topk(k, -1)
    kl, _ = topk_divergence(z.cuda().float(), ids.cuda(), t_vals.cuda(), mask.cuda(), config=cfg)
    kl_ref = ref.topk_divergence_reference(z[:8].double(), ids[:8], t_vals[:8].double(), mask[:8], kind=kind, beta=0.3,
                                           temperature=0.8, tail="bucket")
    kl8, _ = topk_divergence(z[:8].cuda().float(), ids[:8].cuda(), t_vals[:8].cuda(), mask[:8].cuda(), config=cfg)
    assert torch.isfinite(kl)
    assert_close("topk", kl_ref, kl8.double().cpu(), atol=1e-5, rtol=1e-4)


def test_pg_loss_on_cuda_vs_loop_reference():
    g = torch.Generator().manual_seed(1)
    T, K = 257, 3
    lp = -3 * torch.rand(T, dtype=torch.float64, generator=g)
    old = lp + torch.randn(T, dtype=torch.float64, generator=g)
    t_logp = -4 * torch.rand(K, T, dtype=torch.float64, generator=g)
    w = torch.rand(K, T, dtype=torch.float64, generator=g) + 0.05
    mask = torch.rand(T, generator=g) > 0.2
    for agg in ("geometric", "mean", "arithmetic"):
        cfg = MOPDLossConfig(aggregation=agg, is_cap=2.0, is_floor=0.2, adv_clip=1.5)
        lpc = lp.float().cuda().requires_grad_(True)
        out = mopd_pg_loss(lpc, old.float().cuda(), TokenTargets.from_teachers(t_logp.float().cuda(), w.float().cuda()),
                           mask.cuda(), config=cfg)
        (g_out,) = torch.autograd.grad(out.loss, lpc)
        l64 = lp.clone().requires_grad_(True)
        expect = ref.pg_loss_reference(l64, old, t_logp, w, mask, aggregation=agg, is_cap=2.0, is_floor=0.2, adv_clip=1.5)
        (g_ref,) = torch.autograd.grad(expect, l64)
        assert_close(f"{agg} loss", expect.detach(), out.loss.double().cpu(), atol=1e-5, rtol=1e-4)
        assert_close(f"{agg} grad", g_ref, g_out.double().cpu(), atol=1e-6, rtol=1e-4)


CFG = TinyGPTConfig(vocab_size=1024, hidden_size=256, num_layers=2, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=512, max_sequence_length=128)
SHAPE = QwenShape(num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=64)


def test_megatron_teacher_on_cuda_matches_transformers(cuda_megatron, tmp_path):
    from transformers import Qwen3ForCausalLM

    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint

    seed_all(3)
    teacher = build_tiny_gpt(CFG).cuda()
    save_teacher_checkpoint(teacher, str(tmp_path / "t"))
    hf = Qwen3ForCausalLM(hf_qwen3_config(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size,
                                          ffn_hidden_size=CFG.ffn_hidden_size, shape=SHAPE, max_position_embeddings=128))
    sd = {k: v.cpu() for k, v in teacher.state_dict().items() if isinstance(v, torch.Tensor)}
    hf.load_state_dict(megatron_to_hf_qwen3(sd, SHAPE), strict=True)
    seed_all(4)
    host = MegatronTeacherHost(build_tiny_gpt(CFG).cuda(), micro_batch_size=4)
    pool = TeacherPool({"t": MegatronTeacher("t", host, str(tmp_path / "t"), temperature=0.7)},
                       config=TeacherPoolConfig())
    batch = token_batch(6, 96, vocab=CFG.vocab_size, seed=2, score_from=True)
    batch = type(batch)(batch.input_ids.cuda(), batch.lengths.cuda(), batch.score_from.cuda())
    with pool.acquire("t") as lease:
        got = lease.score(batch).take().cpu().clone()  # a copy: the drain receipt needs the original gone
    cpu_batch = type(batch)(batch.input_ids.cpu(), batch.lengths.cpu(), batch.score_from.cpu())
    expect = reference_logp(hf.eval(), cpu_batch, 0.7)
    assert_close("teacher logp", expect, got.double(), atol=2e-4, rtol=1e-4)
    before = torch.cuda.memory_allocated()
    pool.offload("t")
    assert torch.cuda.memory_allocated() < before - 0.5 * sum(v.numel() * 4 for v in sd.values())
    pool.close()


def _student_step(micro, cfg, data_iterator, model):
    from mopd.megatron import mopd_loss_func

    ids = next(data_iterator)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model(ids, pos, None), partial(mopd_loss_func, micro, config=cfg, route_names=["a", "b"])


def test_loss_hook_on_cuda(cuda_megatron):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mopd.megatron import MOPDMicroBatch

    seed_all(5)
    student = build_tiny_gpt(CFG).cuda()
    B, L = 4, 64
    dev = "cuda"
    ids = torch.randint(0, CFG.vocab_size, (B, L), device=dev)
    labels = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    mask = torch.ones(B, L, dtype=torch.bool, device=dev)
    mask[:, -1] = False
    targets = TokenTargets.from_teachers(-3 * torch.rand(2, B, L, device=dev), torch.ones(2, B, L, device=dev))
    micro = MOPDMicroBatch(labels=labels, loss_mask=mask, old_logp=-7 * torch.rand(B, L, device=dev), targets=targets,
                           route_ids=torch.tensor([0, 1, 0, 1], device=dev)[:, None].expand(B, L))
    out = get_forward_backward_func()(forward_step_func=partial(_student_step, micro, MOPDLossConfig()),
                                      data_iterator=iter([ids]), model=student, num_microbatches=1, seq_length=L,
                                      micro_batch_size=B, forward_only=False)
    m = out[0]
    assert m["mopd/a/tokens"][0].item() + m["mopd/b/tokens"][0].item() == mask.sum().item()
    assert all(math.isfinite(v.sum().item()) for v in m.values())
    assert student.output_layer.weight.grad is not None or any(p.main_grad.abs().sum() > 0 for p in student.parameters()
                                                                 if hasattr(p, "main_grad"))


def _grpo_batch(groups: int, n: int, prompt: int, max_resp: int, seed: int):
    """GRPO-shaped rows on CUDA: ``groups`` prompts × ``n`` responses of random lengths."""
    from mopd.backends import TokenBatch

    g = torch.Generator().manual_seed(seed)
    L = prompt + max_resp
    ids = torch.zeros(groups * n, L, dtype=torch.long)
    lengths = torch.zeros(groups * n, dtype=torch.long)
    for i in range(groups):
        p = torch.randint(0, CFG.vocab_size, (prompt,), generator=g)
        for j in range(n):
            r = int(torch.randint(max_resp // 4, max_resp + 1, (1,), generator=g))
            b = i * n + j
            ids[b, :prompt] = p
            ids[b, prompt:prompt + r] = torch.randint(0, CFG.vocab_size, (r,), generator=g)
            lengths[b] = prompt + r
    return TokenBatch(ids.cuda(), lengths.cuda(), torch.full((groups * n,), prompt - 1).cuda())


@pytest.mark.parametrize("dtype,backend", [(torch.float32, "flex"), (torch.bfloat16, "flex"),
                                           (torch.bfloat16, "varlen")])
def test_tree_scored_teacher_on_cuda_matches_plain(cuda_megatron, tmp_path, dtype, backend):
    """harts tree scoring (compiled FlexAttention or FlashAttention-2 varlen, chunked head) vs
    plain padded scoring of the same Megatron teacher on CUDA. fp32: reduction order only;
    bf16 (Float16Module, as trainers run it): bf16 activations on both sides."""
    import dataclasses

    from megatron.core.transformer.module import Float16Module

    from mopd.config import TeacherTreeConfig
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint

    cfg = dataclasses.replace(CFG, params_dtype=dtype)

    def build(seed):
        seed_all(seed)
        m = build_tiny_gpt(cfg).cuda()
        return Float16Module(m.config, m) if dtype == torch.bfloat16 else m

    save_teacher_checkpoint(build(6), str(tmp_path / "t"))
    host = MegatronTeacherHost(build(7), micro_batch_size=4)
    tree = TeacherTreeConfig(enabled=True, backend=backend, chunk_size=256, token_cap=2048, align=128,
                             fallback_compression=1.0)
    plain = MegatronTeacher("plain", host, str(tmp_path / "t"), temperature=0.8)
    tree_t = MegatronTeacher("tree", host, str(tmp_path / "t"), temperature=0.8, tree=tree)
    batch = _grpo_batch(4, 4, 48, 40, seed=3)
    plain.load()
    a = plain.score(batch).double().cpu()
    tree_t.load()
    b = tree_t.score(batch).double().cpu()
    mask = batch.label_mask().cpu()
    diff = (a - b).abs()[mask]
    print(f"{dtype} {backend}: C={tree_t.last_tree_stats['compression']:.2f} max |Δ| {diff.max():.2e} "
          f"mean {diff.mean():.2e} tokens {int(mask.sum())}")
    assert tree_t.last_tree_stats["compression"] > 1.5 and a[mask].abs().mean() > 1.0
    if dtype == torch.float32:
        assert_close("tree vs plain fp32", a, b, atol=2e-4, rtol=1e-4)
    else:  # bf16 activations: 2^-8 relative rounding per op on both sides, log-probs ~ -7
        assert diff.mean() < 0.02 and diff.max() < 0.2
