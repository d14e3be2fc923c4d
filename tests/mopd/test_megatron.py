"""Megatron teacher (real tiny GPTModel on CPU) and the loss hook through Megatron's schedule."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, seed_all
from mopd.config import MOPDLossConfig, RoutingSpec, TeacherPoolConfig
from mopd.errors import FingerprintMismatchError
from mopd.hf_weights import QwenShape, hf_qwen3_config, megatron_to_hf_qwen3
from mopd.objectives import TokenTargets, mopd_pg_loss
from mopd.routing import score_routed
from mopd.teachers import TeacherPool, TeacherState
from tests.mopd.mopd_helpers import reference_logp, token_batch

CFG = TinyGPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=64, max_sequence_length=32)
SHAPE = QwenShape(num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=8)


def _gpt(seed: int, cfg: TinyGPTConfig = CFG):
    seed_all(seed)
    model = build_tiny_gpt(cfg)
    with torch.no_grad():
        model.output_layer.weight.mul_(30.0)  # teachers that differ visibly
    return model


def _as_hf(model):
    """The same weights as an independent transformers Qwen3 implementation."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM(hf_qwen3_config(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size,
                                          ffn_hidden_size=CFG.ffn_hidden_size, shape=SHAPE,
                                          max_position_embeddings=CFG.max_sequence_length))
    sd = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    hf.load_state_dict(megatron_to_hf_qwen3(sd, SHAPE), strict=True)
    return hf.eval()


def test_token_logprobs_matches_log_softmax(cpu_megatron):
    from mopd.megatron import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 64, generator=g, requires_grad=True)
    labels = torch.randint(0, 64, (3, 7), generator=g)
    lp = token_logprobs(logits, labels, temperature=0.7)
    ref = torch.log_softmax(logits.detach().double() / 0.7, -1).gather(-1, labels[..., None])[..., 0]
    assert_close("logp", ref, lp, atol=1e-6, rtol=1e-6)
    (g1,) = torch.autograd.grad(lp.sum(), logits)
    x = logits.detach().double().requires_grad_(True)
    (g2,) = torch.autograd.grad(torch.log_softmax(x / 0.7, -1).gather(-1, labels[..., None]).sum(), x)
    assert_close("grad", g2, g1, atol=1e-6, rtol=1e-6)


@pytest.mark.timeout(120)
def test_token_logprobs_leave_padded_vocab_out(cpu_megatron):
    """vocab_size=40 of 64 columns: log-probs and gradients of log_softmax over the first 40 (fp64)."""
    from mopd.megatron import token_logprobs

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 64, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (3, 7), generator=g)
    lp = token_logprobs(logits, labels, temperature=0.7, vocab_size=40)
    x = logits.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(x[..., :40] / 0.7, -1).gather(-1, labels[..., None])[..., 0]
    assert_close("logp", ref, lp, atol=1e-6, rtol=1e-6)
    (g1,) = torch.autograd.grad(lp.sum(), logits)
    (g2,) = torch.autograd.grad(ref.sum(), x)
    assert_close("grad", g2, g1, atol=1e-6, rtol=1e-6)
    assert g1[..., 40:].abs().max() == 0
    assert torch.equal(token_logprobs(logits, labels, vocab_size=64), token_logprobs(logits, labels))


@pytest.mark.timeout(120)
def test_megatron_teachers_swap_in_place_and_match_transformers(cpu_megatron, tmp_path):
    from megatron.core import dist_checkpointing

    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint

    a, b = _gpt(1), _gpt(2)
    save_teacher_checkpoint(a, str(tmp_path / "a"))
    (tmp_path / "b").mkdir()
    dist_checkpointing.save(b.sharded_state_dict(), str(tmp_path / "b"))
    hf_a, hf_b = _as_hf(a), _as_hf(b)
    host = MegatronTeacherHost(_gpt(3), micro_batch_size=2)
    params = list(host.chunks[0].parameters())
    teachers = {"a": MegatronTeacher("a", host, str(tmp_path / "a"), temperature=0.8),
                "b": MegatronTeacher("b", host, str(tmp_path / "b"), temperature=0.8)}
    pool = TeacherPool(teachers, config=TeacherPoolConfig())
    spec = RoutingSpec(routes={"ra": {"a": 1.0}, "rb": {"b": 1.0}, "mix": {"a": 0.5, "b": 0.5}})
    batch = token_batch(5, 12, vocab=64, seed=4, score_from=True)
    ref_a, ref_b = reference_logp(hf_a, batch, 0.8), reference_logp(hf_b, batch, 0.8)
    routes = ["ra", "rb", "mix", "ra", "rb"]
    for _ in range(2):  # second round: b resident first (reuse), then a comes back by onload
        targets, stats = score_routed(pool, batch, routes, spec, dtype=torch.float64)
        expect = torch.stack([ref_a[0], ref_b[1], 0.5 * (ref_a[2] + ref_b[2]), ref_a[3], ref_b[4]])
        assert_close("S", expect, targets.logp_sum, atol=2e-5, rtol=1e-5)
    assert host.chunks[0] is host.chunks[0] and list(host.chunks[0].parameters())[0] is params[0]  # in place
    assert pool.states() == {"a": TeacherState.RESIDENT, "b": TeacherState.OFFLOADED}
    assert teachers["b"]._offloaded is not None
    pool.offload("a")
    assert all(p.numel() == 0 for p in params)  # device storage released while offloaded
    pool.close()


def test_architecture_mismatch_is_refused(cpu_megatron, tmp_path):
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint

    other = TinyGPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=96, max_sequence_length=32)
    save_teacher_checkpoint(_gpt(1, other), str(tmp_path / "x"))
    host = MegatronTeacherHost(_gpt(3))
    pool = TeacherPool({"x": MegatronTeacher("x", host, str(tmp_path / "x"))}, config=TeacherPoolConfig())
    with pytest.raises(FingerprintMismatchError, match=r"mlp.linear_fc1.weight is \(192, 32\).*resident model has \(128, 32\)"):
        pool.acquire("x")
    assert pool.state("x") is TeacherState.BROKEN
    pool.close()


def _student_step(micro, cfg_loss, routes, data_iterator, model):
    from mopd.megatron import mopd_loss_func

    ids = next(data_iterator)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return model(ids, pos, None), partial(mopd_loss_func, micro, config=cfg_loss, route_names=routes, temperature=0.9,
                                          rl_loss_fn=lambda lp, m: -(lp * m.loss_mask).sum())


@pytest.mark.timeout(120)
def test_loss_hook_through_megatron_schedule(cpu_megatron):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mopd.megatron import MOPDMicroBatch

    student = _gpt(5)
    g = torch.Generator().manual_seed(1)
    B, L = 3, 10
    ids = torch.randint(0, 64, (B, L), generator=g)
    labels = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[:, -1] = False
    mask[2, :4] = False
    old = -1 - 8 * torch.rand(B, L, generator=g)  # ratios on both sides of the cap
    t_logp = -3 * torch.rand(2, B, L, generator=g)
    w = torch.tensor([[1.0], [0.5], [0.0]]).expand(B, L)
    targets = TokenTargets.from_teachers(t_logp, torch.stack([torch.ones(B, L), w]))
    route_ids = torch.tensor([0, 1, 1])[:, None].expand(B, L)
    micro = MOPDMicroBatch(labels=labels, loss_mask=mask, old_logp=old, targets=targets, route_ids=route_ids)
    cfg = MOPDLossConfig(is_cap=2.0, adv_clip=3.0, rl_coef=0.25, distill_coef=1.0)
    fb = get_forward_backward_func()
    out = fb(forward_step_func=partial(_student_step, micro, cfg, ["math", "code"]), data_iterator=iter([ids]),
             model=student, num_microbatches=1, seq_length=L, micro_batch_size=B, forward_only=False)
    metrics = out[0]
    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    # expected: plain torch on the same logits
    for p in student.parameters():
        p.grad = None
    logits = student(ids, torch.arange(L).expand(B, L), None)
    lp = torch.log_softmax(logits.double() / 0.9, -1).gather(-1, labels[..., None])[..., 0]
    mo = mopd_pg_loss(lp, old.double(), TokenTargets(*(x.double() for x in (targets.logp_sum, targets.weight_sum))),
                      mask, config=cfg)
    total = (1.0 * mo.loss_sum + 0.25 * -(lp * mask).sum()) / mask.sum()
    total.backward()
    for n, p in student.named_parameters():
        assert_close(f"grad {n}", p.grad, grads[n], atol=2e-5, rtol=2e-4)
    assert grads["output_layer.weight"].abs().sum() > 0
    n_math, n_code = int(mask[0].sum()), int(mask[1:].sum())
    assert metrics["mopd/math/tokens"].tolist() == [n_math, 1.0] and metrics["mopd/code/tokens"].tolist() == [n_code, 1.0]
    assert metrics["mopd/is_weight"][1].item() == n_math + n_code
    reward = mo.stats["reward"].float()
    assert_close("reward math", reward[0].sum(), metrics["mopd/math/reward"][0], atol=1e-4, rtol=1e-5)
    assert_close("weight code", (targets.weight_sum * mask)[1:].sum(), metrics["mopd/code/teacher_weight"][0],
                 atol=1e-5, rtol=0)
    frac = metrics["mopd/is_capped_frac"]
    assert 0 < frac[0] < frac[1]


def test_every_teacher_config_value_reaches_the_backends(cpu_megatron, tmp_path):
    import dataclasses

    from mopd.config import DivergenceConfig, MOPDConfig, TeacherSpec
    from mopd.megatron import MegatronTeacherHost, build_teacher_pool

    covered = {"backend", "checkpoint", "url", "timeout_s", "max_retries", "retry_backoff_s", "max_batch",
               "server_scales_temperature", "vocab_size", "hf_path"}  # hf_path: pre-flight fingerprints (test_preflight)
    assert {f.name for f in dataclasses.fields(TeacherSpec)} == covered, "cover the new TeacherSpec field"
    cfg = MOPDConfig(
        teachers={"m": TeacherSpec(checkpoint=str(tmp_path / "m"), vocab_size=40),
                  "h": TeacherSpec(backend="http", url="http://h:1", timeout_s=7.0, max_retries=5,
                                   retry_backoff_s=0.25, max_batch=3, server_scales_temperature=True,
                                   vocab_size=48)},
        routing=RoutingSpec(routes={"r": {"m": 1.0, "h": 1.0}}), rollout_temperature=0.6,
        divergence=DivergenceConfig(temperature=0.6), pool=TeacherPoolConfig(prefetch=False, wait_timeout_s=12.0))
    host = MegatronTeacherHost(_gpt(3))
    pool = build_teacher_pool(cfg, host=host)
    h, m = pool._backends["h"], pool._backends["m"]
    assert (h.url, h.timeout_s, h.max_retries, h.retry_backoff_s, h.max_batch, h.temperature, h.vocab_size) == (
        "http://h:1", 7.0, 5, 0.25, 3, 0.6, 48)
    assert (m.checkpoint, m.temperature, m.host, m.vocab_size) == (str(tmp_path / "m"), 0.6, host, 40)
    assert pool.config.prefetch is False and pool.config.wait_timeout_s == 12.0
    with pytest.raises(ValueError, match="no MegatronTeacherHost"):
        build_teacher_pool(cfg)
    pool.close()
