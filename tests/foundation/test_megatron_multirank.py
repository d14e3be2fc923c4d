"""Real Megatron-Core on 2 gloo ranks (CPU): DP=2, TP=2, PP=2, checked against 1-rank references.

Each spawned run returns tensors; the checks against an unsharded reference run in the pytest
process (1 rank, ``cpu_megatron`` fixture) after reloading the ranks' ``dist_checkpointing``
checkpoint at TP=1/PP=1, which also exercises checkpoint resharding.
"""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import (
    TinyGPTConfig,
    assert_close,
    build_tiny_gpt,
    init_megatron,
    run_ranks,
    seed_all,
)

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]

SEQ, VOCAB = 12, 128


def _tokens(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _token_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``tokens`` (labels = tokens shifted by one)."""
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    labels = torch.roll(tokens, -1, dims=1)
    return model(tokens, pos, None, labels=labels)[:, :-1].float().mean()


def _ddp_and_optimizer(model, *, optimizer: str, distributed: bool, clip_grad: float = 0.0, lr: float = 1e-2):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
        model,
    )
    cfg = OptimizerConfig(
        optimizer=optimizer, lr=lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        use_distributed_optimizer=distributed, clip_grad=clip_grad, bf16=False, fp16=False,
    )
    return ddp, get_megatron_optimizer(cfg, [ddp])


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# --------------------------------------------------------------------------------------------- DP=2
def _dp2_body(rank: int, world: int, ckpt_dir: str):
    from megatron.core import dist_checkpointing

    init_megatron(seed=11)
    model = build_tiny_gpt(TinyGPTConfig())
    seed_all(11)
    reference = build_tiny_gpt(TinyGPTConfig())  # plain autograd + torch AdamW on the full batch
    assert torch.equal(_flat_params(model), _flat_params(reference))
    ddp, opt = _ddp_and_optimizer(model, optimizer="adam", distributed=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    full = _tokens(4)
    for _ in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        _token_loss(ddp, full[2 * rank: 2 * rank + 2]).backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
        ref_opt.zero_grad()
        _token_loss(reference, full).backward()
        ref_opt.step()
    params, ref_params = _flat_params(model), _flat_params(reference)
    gathered = [torch.empty_like(params) for _ in range(world)]
    torch.distributed.all_gather(gathered, params)

    # distributed-optimizer checkpoint: save model + optimizer, reload into fresh ones, step both
    model_sd = model.sharded_state_dict()
    # megatron-core 0.19.2's default optimizer format ("fully_sharded_model_space") is rejected by
    # its own validation (flattened_range); the reshardable format is the supported one.
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)},
                            ckpt_dir)
    seed_all(99)  # different init: the load must overwrite it
    fresh = build_tiny_gpt(TinyGPTConfig())
    fresh_ddp, fresh_opt = _ddp_and_optimizer(fresh, optimizer="adam", distributed=True)
    fresh_sd = fresh.sharded_state_dict()
    # Without TE/Apex, megatron-core's DistributedOptimizer.state_dict() needs materialized torch
    # optimizer state (it reads each param's 'step'); Megatron's own dummy-state initializer does that.
    for inner in getattr(fresh_opt, "chained_optimizers", [fresh_opt]):
        inner._init_optimizer_states_with_dummy_values()
    loaded = dist_checkpointing.load(
        {"model": fresh_sd, "optimizer": fresh_opt.sharded_state_dict(fresh_sd, is_loading=True, metadata=meta)}, ckpt_dir
    )
    fresh.load_state_dict(loaded["model"], strict=False)
    with torch.no_grad():  # fp32 params are their own main params: the load copies into leaf views
        fresh_opt.load_state_dict(loaded["optimizer"])
    inner, fresh_inner = opt.chained_optimizers[0].optimizer, fresh_opt.chained_optimizers[0].optimizer
    pairs = [(p, q) for g, h in zip(inner.param_groups, fresh_inner.param_groups) for p, q in zip(g["params"], h["params"])]
    return {
        "params": params, "ref_params": ref_params, "replicas": gathered,
        "resumed_params": _flat_params(fresh),
        "resumed_moments": all(
            torch.equal(inner.state[p][k], fresh_inner.state[q][k]) for p, q in pairs for k in ("exp_avg", "exp_avg_sq")
        ),
        "steps": (inner.state[pairs[0][0]]["step"].item(), fresh_inner.state[pairs[0][1]]["step"].item()),
    }


def _muon_dp2_body(rank: int, world: int):
    init_megatron(seed=5)
    model = build_tiny_gpt(TinyGPTConfig())
    before = _flat_params(model).clone()
    ddp, opt = _ddp_and_optimizer(model, optimizer="muon", distributed=False, lr=2e-2)
    full = _tokens(4, seed=3)
    losses = []
    for _ in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = _token_loss(ddp, full[2 * rank: 2 * rank + 2])
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm is not None and grad_norm > 0
        losses.append(loss.item())
    params = _flat_params(model)
    gathered = [torch.empty_like(params) for _ in range(world)]
    torch.distributed.all_gather(gathered, params)
    return {"before": before, "replicas": gathered, "optimizer": type(opt).__name__}


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("dp2")
    return run_ranks(_dp2_body, 2, str(ckpt), timeout=200)


def test_dp2_distributed_adam_matches_full_batch_reference(dp2_run):
    for r in dp2_run:
        assert torch.equal(r["replicas"][0], r["replicas"][1]), "DP replicas diverged"
        # fp32: DDP averages two half-batch gradients (another summation order than the full batch);
        # Adam's m/sqrt(v) turns that rounding into O(lr) flips on elements whose gradient is ~0,
        # so bound the worst element loosely and the RMS error tightly.
        assert_close("params vs full-batch AdamW", r["ref_params"], r["params"], atol=5e-5)
        rms = (r["params"] - r["ref_params"]).norm() / r["ref_params"].norm()
        assert rms < 1e-5, f"params vs full-batch AdamW: rms ratio {rms:.3e}"


def test_dp2_distributed_adam_checkpoint_restores_params_and_moments(dp2_run):
    for r in dp2_run:
        assert_close("resumed params", r["params"], r["resumed_params"], atol=0.0)
        assert r["resumed_moments"], "exp_avg/exp_avg_sq not restored bit-exactly"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="megatron-core 0.19.2 without TE/Apex: dp_reshardable load keeps the "
                   "dummy-initialized Adam step (1) instead of the saved one; optim_staged owns its step counters")
def test_dp2_distributed_adam_checkpoint_restores_step(dp2_run):
    for r in dp2_run:
        assert r["steps"][0] == r["steps"][1] == 3


def test_dp2_muon_keeps_replicas_identical():
    out = run_ranks(_muon_dp2_body, 2, timeout=200)
    for r in out:
        assert torch.equal(r["replicas"][0], r["replicas"][1])
        assert not torch.equal(r["before"], r["replicas"][0]), "Muon step did not change the parameters"
        assert torch.isfinite(r["replicas"][0]).all()


# --------------------------------------------------------------------------------------------- TP=2
def _tp2_body(rank: int, world: int, ckpt_dir: str):
    from megatron.core import dist_checkpointing, parallel_state

    init_megatron(tp=2, seed=21)
    cfg = TinyGPTConfig(tensor_model_parallel_size=2)
    model = build_tiny_gpt(cfg)
    tokens = _tokens(2, seed=4)
    pos = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad():
        local_logits = model(tokens, pos, None)
    shards = [torch.empty_like(local_logits) for _ in range(2)]
    torch.distributed.all_gather(shards, local_logits, group=parallel_state.get_tensor_model_parallel_group())
    logits = torch.cat(shards, dim=-1)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)

    ddp, opt = _ddp_and_optimizer(model, optimizer="adam", distributed=False, clip_grad=1e-3)
    ddp.zero_grad_buffer()
    _token_loss(ddp, tokens).backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()

    seed_all(21)
    muon_model = build_tiny_gpt(cfg)
    muon_ddp, muon_opt = _ddp_and_optimizer(muon_model, optimizer="muon", distributed=False, lr=2e-2)
    muon_ddp.zero_grad_buffer()
    _token_loss(muon_ddp, tokens).backward()
    muon_ddp.finish_grad_sync()
    muon_ok, _, _ = muon_opt.step()
    return {"logits": logits, "grad_norm": grad_norm, "ok": ok and muon_ok,
            "muon_finite": all(torch.isfinite(p).all().item() for p in muon_model.parameters())}


def _load_unsharded(ckpt_dir, cfg: TinyGPTConfig):
    from megatron.core import dist_checkpointing

    model = build_tiny_gpt(cfg)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert all(k.endswith("_extra_state") for k in missing + unexpected), (missing, unexpected)
    return model


def test_tp2_logits_gradnorm_and_checkpoint_match_tp1(tmp_path, cpu_megatron):
    ckpt = tmp_path / "tp2"
    ckpt.mkdir()
    out = run_ranks(_tp2_body, 2, str(ckpt), timeout=200)
    assert all(r["ok"] and r["muon_finite"] for r in out)
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=1e-6)

    model = _load_unsharded(ckpt, TinyGPTConfig())  # TP=1 in this process
    tokens = _tokens(2, seed=4)
    with torch.no_grad():
        ref_logits = model(tokens, torch.arange(SEQ).expand_as(tokens), None)
    for r in out:
        assert_close("TP=2 logits vs TP=1", ref_logits, r["logits"], atol=1e-5, rtol=1e-5)
    _token_loss(model, tokens).backward()
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
    assert out[0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)


# --------------------------------------------------------------------------------------------- PP=2
def _pp2_body(rank: int, world: int, ckpt_dir: str):
    from megatron.core import dist_checkpointing
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_megatron(pp=2, seed=31)
    model = build_tiny_gpt(TinyGPTConfig(pipeline_model_parallel_size=2))
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    ddp, opt = _ddp_and_optimizer(model, optimizer="adam", distributed=False)
    micro = [_tokens(2, seed=s) for s in (7, 8)]
    batches = iter(micro)

    def forward_step(data_iterator, m):
        tokens = next(data_iterator)
        pos = torch.arange(SEQ).expand_as(tokens)
        out = m(tokens, pos, None, labels=torch.roll(tokens, -1, dims=1))

        def loss_func(per_token):
            loss = per_token[:, :-1].float().mean()
            # clone: the schedule divides the returned loss in place (detach() would alias it)
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    ddp.zero_grad_buffer()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches, model=[ddp], num_microbatches=2,
        seq_length=SEQ, micro_batch_size=2, forward_only=False,
    )
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    return {"losses": [r["loss"] for r in reports], "grad_norm": grad_norm, "ok": ok}


def test_pp2_schedule_matches_unpipelined(tmp_path, cpu_megatron):
    ckpt = tmp_path / "pp2"
    ckpt.mkdir()
    out = run_ranks(_pp2_body, 2, str(ckpt), timeout=200)
    assert out[0]["losses"] == [] and len(out[1]["losses"]) == 2  # loss lives on the last stage
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=1e-6)

    model = _load_unsharded(ckpt, TinyGPTConfig())
    total = 0.0
    for i, s in enumerate((7, 8)):
        loss = _token_loss(model, _tokens(2, seed=s))
        assert out[1]["losses"][i].item() == pytest.approx(loss.item(), rel=1e-5)
        total = total + loss / 2  # the schedule divides each micro-batch loss by their number
    total.backward()
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
    assert out[1]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
