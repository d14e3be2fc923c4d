"""Checkpoints across data-parallel sizes, and layout changes that are refused (issue #24 item 2).

Each case is a round trip through another DP size: save at DP=a, load at DP=b (model parameters
must equal the saved ones), save there at once, load back at DP=a: every rank's model parameters,
staged state (masters, momenta, Adam moments) and step counters equal what it saved, exactly.
State lost, zeroed or mixed up at DP=b would show. The loaded run also takes a step.

* the staged Muon chain (fp32, ``FP32Optimizer`` leaves): DP=2 -> 1 -> 2;
* the layer-wise distributed Muon (bf16; each DP rank owns whole matrices, Adam in a byte-sharded
  ``DistributedOptimizer``): DP=2 -> 1 -> 2;
* staged AdamW (distributed optimizer): DP=1 -> 2 -> 1 (loading at a larger DP size);
* MoE at EP=2 loaded at EP=1: refused with ``CheckpointLayoutError`` naming both layouts.
"""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import run_ranks


def _build(kind: str, seed: int, *, ep: int = 1, residency: str = "staged"):
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all
    from optim_staged.config import AdamWConfig, MuonConfig, SlotConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer, megatron_muon_config

    seed_all(seed)
    bf16 = kind in ("layerwise", "adamw", "moe")
    tcfg = TinyGPTConfig(num_layers=2 if kind != "moe" else 1, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                         num_moe_experts=4 if kind == "moe" else None, expert_model_parallel_size=ep)
    model = build_tiny_gpt(tcfg)
    if torch.cuda.is_available():
        model = model.cuda()
    if bf16:
        model = Float16Module(model.config, model)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=kind != "muon")
    layout = None
    if kind == "layerwise":  # Megatron's layer-wise layout: whole matrices per DP shard
        from megatron.core.optimizer.layer_wise_optimizer import (
            LayerWiseDistributedOptimizer,
            tag_params_for_buffer_routing,
        )

        tag_params_for_buffer_routing([model])
        layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
            [p for p in model.parameters() if p.requires_grad], ddp.bucket_size, torch.distributed.get_world_size(),
            ddp)
    model = DDP(model.config, ddp, model, full_param_layout=layout)
    model.config.finalize_model_grads_func = finalize_model_grads
    cfg = StagedOptimizerConfig(algorithm="muon" if kind in ("muon", "layerwise") else "adamw", residency=residency,
                                muon=MuonConfig(lr=0.02), adamw=AdamWConfig(lr=2e-3, impl="foreach"),
                                slots=SlotConfig(slot_numel=1 << 14, num_slots=2))
    mcfg = megatron_muon_config(cfg, [model], use_layer_wise_distributed_optimizer=True) if kind == "layerwise" else None
    return model, get_staged_optimizer(cfg, [model], megatron_config=mcfg)


def reshard_body(rank: int, world_size: int, kind: str, load_from: str | None, save_to: str):
    """Train 2 steps (or load ``load_from``), record the state, save to ``save_to``, take a step."""
    from mcore_distill.testing import init_megatron
    from optim_staged.megatron import load_checkpoint, save_checkpoint
    from tests.optim_staged.ckpt_faults import fingerprint, staged_inners, train

    init_megatron(tp=1, pp=1, seed=3)
    model, optim = _build(kind, seed=3 if load_from is None else 99)
    if load_from is None:
        train(model, optim, range(2 * rank, 2 * rank + 2))
    else:
        load_checkpoint(model, optim, load_from)
    fp = fingerprint(model, optim)
    save_checkpoint(model, optim, save_to)
    train(model, optim, range(50 + rank, 51 + rank))  # the loaded state trains
    after = fingerprint(model, optim)
    return {"fp": fp, "moved": [k for k in fp if not torch.equal(fp[k], after[k])],
            "finite": all(torch.isfinite(v).all() for v in after.values()),
            "staged": [type(x).__name__ for x in staged_inners(optim)],
            "numel": [x.residency["staged_numel"] for x in staged_inners(optim)]}


def _round_trip(tmp_path, kind: str, sizes: tuple[int, int]):
    a, b = sizes
    first = run_ranks(reshard_body, a, kind, None, str(tmp_path / "a"), timeout=240)
    middle = run_ranks(reshard_body, b, kind, str(tmp_path / "a"), str(tmp_path / "b"), timeout=240)
    back = run_ranks(reshard_body, a, kind, str(tmp_path / "b"), str(tmp_path / "c"), timeout=240)
    model_keys = [k for k in first[0]["fp"] if k.startswith("model.")]
    for r in middle:  # model parameters are whole on every rank: equal to what was saved
        for k in model_keys:
            assert torch.equal(r["fp"][k], first[0]["fp"][k]), k
    for r0, r1 in zip(first, back):  # every rank's full state back, exactly
        assert r0["fp"].keys() == r1["fp"].keys()
        bad = [k for k in r0["fp"] if not torch.equal(r0["fp"][k], r1["fp"][k])]
        assert not bad, f"{kind} DP={a}->{b}->{a}: differs in {bad}"
    for r in first + middle + back:
        assert r["finite"] and any(k.startswith("leaf") for k in r["moved"]), r["moved"]
    return first, middle, back


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_muon_chain_state_dp2_to_dp1_and_back(tmp_path):
    first, middle, _ = _round_trip(tmp_path, "muon", (2, 1))
    assert sorted(first[0]["staged"]) == ["StagedAdamW", "StagedMuon"]
    assert first[0]["fp"]["leaf0.steps"].tolist() == [2] * len(first[0]["fp"]["leaf0.steps"])


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_layerwise_distributed_muon_dp2_to_dp1_and_back(tmp_path):
    first, middle, _ = _round_trip(tmp_path, "layerwise", (2, 1))
    assert "StagedMuon" in first[0]["staged"] and "StagedAdamW" in first[0]["staged"]
    muon = first[0]["staged"].index("StagedMuon")
    # DP=2: each rank steps only the matrices it owns; DP=1: one rank owns them all
    assert 0 < first[0]["numel"][muon] < middle[0]["numel"][muon]
    assert first[0]["numel"][muon] + first[1]["numel"][muon] == middle[0]["numel"][muon]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_adamw_loads_at_larger_dp_and_back(tmp_path):
    first, middle, _ = _round_trip(tmp_path, "adamw", (1, 2))
    assert first[0]["staged"] == ["StagedAdamW"]
    assert middle[0]["numel"][0] + middle[1]["numel"][0] >= first[0]["numel"][0]  # DP shards


def moe_ep_body(rank: int, world_size: int, ckpt: str, ep: int, save: bool):
    from mcore_distill.testing import init_megatron
    from optim_staged import CheckpointLayoutError
    from optim_staged.megatron import load_checkpoint, save_checkpoint
    from tests.optim_staged.ckpt_faults import train

    init_megatron(tp=1, pp=1, ep=ep, seed=3)
    model, optim = _build("moe", seed=3, ep=ep)
    if save:
        train(model, optim, range(rank, rank + 1))
        save_checkpoint(model, optim, ckpt)
        return None
    before = [p.detach().clone() for p in model.parameters()]
    try:
        load_checkpoint(model, optim, ckpt)
    except CheckpointLayoutError as e:
        return {"error": str(e), "untouched": all(torch.equal(a, b) for a, b in zip(before, model.parameters()))}
    return {"error": None}


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_moe_ep2_checkpoint_at_ep1_is_refused_naming_both_layouts(tmp_path):
    """Staged AdamW, 4 experts. At EP=2 each rank owns 2 experts and the expert optimizer shards
    over expert-DP=1; at EP=1 every rank holds all 4 (expert-DP=2). An EP change moves experts
    between ranks and changes the expert optimizer's DP group; it is not verified to reshard, so
    it is refused before anything is read, with a message naming both layouts."""
    ckpt = str(tmp_path / "ckpt")
    run_ranks(moe_ep_body, 2, ckpt, 2, True, timeout=300)
    for r in run_ranks(moe_ep_body, 2, ckpt, 1, False, timeout=300):
        assert r["error"] is not None, "EP=2 checkpoint loaded at EP=1 without an error"
        assert "expert_model_parallel_size=2" in r["error"] and "expert_model_parallel_size=1" in r["error"]
        assert "saved layout: TP=1 PP=1 EP=2" in r["error"] and "this run: TP=1 PP=1 EP=1" in r["error"]
        assert r["untouched"]
