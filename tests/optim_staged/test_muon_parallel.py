"""Staged Muon in every tensor-parallel mode of Megatron's ``TensorParallelMuon`` (duplicated,
distributed, blockwise), with MoE experts under expert-TP and under EP > 1, against the stock
Megatron Muon chain on the same ranks (issue #24 item 1).

On CPU (gloo) both sides run the same orthogonalization code on the same fp32 inputs, so the
comparison is exact, Newton-Schulz included; the identity orthogonalizer is exact too. The GPU
variant (2 GPUs, NCCL, CUDA streams) uses the GPU lane's bound for Newton-Schulz, 2e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore_distill.testing import run_ranks

LAYOUTS = {
    # name: (TP, expert-TP, EP, MoE experts) on 2 ranks
    "tp2_dense": (2, 2, 1, None),
    "etp2_moe": (1, 2, 1, 4),  # experts sharded over expert-TP=2, attention/dense data-parallel
    "ep2_moe": (1, 1, 2, 4),  # each EP rank owns 2 of the 4 experts
}
"""MoE with TP > 1 needs sequence parallelism in Megatron, which its torch norms (no TE or Apex
here) do not support; expert-TP is therefore tested with TP=1, and dense TP separately."""


def _build(residency: str, tp_mode: str, *, tp: int, etp: int, ep: int, experts: int | None, seed: int = 3,
           identity: bool = False):
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all
    from optim_staged.config import AdamWConfig, MuonConfig, SlotConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer

    seed_all(seed)
    model = build_tiny_gpt(TinyGPTConfig(num_layers=1, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                         num_moe_experts=experts, moe_ffn_hidden_size=32,
                                         extra={"expert_tensor_parallel_size": etp}))
    if torch.cuda.is_available():
        model = model.cuda()
    model = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    cfg = StagedOptimizerConfig(algorithm="muon", residency=residency,
                                muon=MuonConfig(lr=0.02, nesterov=True, tp_mode=tp_mode),
                                adamw=AdamWConfig(impl="foreach"),  # torch's CPU AdamW op order
                                slots=SlotConfig(slot_numel=1 << 13, num_slots=2))
    optim = get_staged_optimizer(cfg, [model])
    if identity:
        for leaf in optim.chained_optimizers:
            inner = leaf.optimizer
            tpm = inner.orthogonalize.__self__ if residency == "staged" and hasattr(inner, "orthogonalize") else inner
            if hasattr(tpm, "scaled_orthogonalize_fn"):
                tpm.scaled_orthogonalize_fn = lambda grad, tp_group, partition_dim=None: grad
    return model, optim


def _train(model, optim, steps: int, rank: int) -> None:
    from tests.optim_staged.ckpt_faults import train

    for s in range(steps):  # different data on every rank
        train(model, optim, range(100 * s + 10 * rank, 100 * s + 10 * rank + 1))


def _leaves(optim) -> list[str]:
    return sorted(type(leaf.optimizer).__name__ for leaf in optim.chained_optimizers)


def parallel_body(rank: int, world_size: int, layout: str, modes: list[str], identity: bool):
    from megatron.core import parallel_state

    tp, etp, ep, experts = LAYOUTS[layout]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    out = {"device": "cuda" if torch.cuda.is_available() else "cpu",
           "tp": parallel_state.get_tensor_model_parallel_world_size(),
           "etp": parallel_state.get_expert_tensor_parallel_world_size(),
           "ep": parallel_state.get_expert_model_parallel_world_size()}
    for mode in modes:
        runs = {}
        for residency in ("gpu", "staged"):
            model, optim = _build(residency, mode, tp=tp, etp=etp, ep=ep, experts=experts, identity=identity)
            _train(model, optim, 3, rank)
            params = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
            expert_tp = sorted(n for n, p in model.named_parameters() if getattr(p, "expert_tp", False))
            runs[residency] = {"leaves": _leaves(optim), "params": params, "expert_tp": expert_tp}
        out[mode] = runs
    return out


def _check(results, modes, *, moe: bool, atol: float = 0.0, rtol: float = 0.0) -> None:
    for r in results:
        for mode in modes:
            gpu, staged = r[mode]["gpu"], r[mode]["staged"]
            n_muon = 2 if moe else 1  # dense Muon leaf (+ the expert-parallel one)
            assert gpu["leaves"].count("TensorParallelMuon") == n_muon, gpu["leaves"]
            assert staged["leaves"].count("StagedMuon") == n_muon and "TensorParallelMuon" not in staged["leaves"]
            assert bool(staged["expert_tp"]) == moe and all("experts" in n for n in staged["expert_tp"])
            for name, ref in gpu["params"].items():
                if atol == rtol == 0.0:
                    np.testing.assert_array_equal(staged["params"][name], ref, err_msg=f"{mode} {name}")
                else:
                    np.testing.assert_allclose(staged["params"][name], ref, atol=atol, rtol=rtol,
                                               err_msg=f"{mode} {name}")


MODES = ["duplicated", "distributed", "blockwise"]


@pytest.mark.multirank
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["tp2_dense", "etp2_moe"])
def test_staged_muon_every_tp_mode(layout):
    """duplicated / distributed / blockwise at TP=2 (dense matrices orthogonalized over the TP
    group, QKV split on) and at expert-TP=2 (4 MoE experts, orthogonalized over the expert-TP
    group through ``expert_tp``): exact vs the stock Muon chain, Newton-Schulz included."""
    results = run_ranks(parallel_body, 2, layout, MODES, False, timeout=360)
    tp, etp, _, experts = LAYOUTS[layout]
    assert (results[0]["tp"], results[0]["etp"]) == (tp, etp)
    _check(results, MODES, moe=experts is not None)
    # the modes really differ (blockwise: no collective; distributed: Gram all-reduce instead of
    # an all-gather), and the two ranks hold different shards of the TP-sharded matrices
    key = "linear_fc1" if experts else "linear_qkv"
    for a, b in (("duplicated", "blockwise"), ("duplicated", "distributed")):
        assert any(not np.array_equal(results[0][a]["gpu"]["params"][n], results[0][b]["gpu"]["params"][n])
                   for n in results[0][a]["gpu"]["params"] if key in n), (a, b)
    name = next(n for n in results[0]["blockwise"]["gpu"]["params"] if key in n)
    assert not np.array_equal(results[0]["blockwise"]["gpu"]["params"][name],
                              results[1]["blockwise"]["gpu"]["params"][name])


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_staged_muon_moe_experts_under_ep2():
    """EP=2, 4 experts: each EP rank owns 2 experts' matrices (its expert Muon leaf steps only
    those); Newton-Schulz and identity orthogonalizers, exact vs the stock Muon chain."""
    for identity in (False, True):
        results = run_ranks(parallel_body, 2, "ep2_moe", ["duplicated"], identity, timeout=240)
        assert results[0]["ep"] == 2
        _check(results, ["duplicated"], moe=True)
        experts = [n for n in results[0]["duplicated"]["gpu"]["params"] if "local_experts" in n]
        assert len({n.split("local_experts.")[1].split(".")[0] for n in experts}) == 2  # 2 local experts per rank
        for n in experts:  # EP ranks hold different experts
            assert not np.array_equal(results[0]["duplicated"]["gpu"]["params"][n],
                                      results[1]["duplicated"]["gpu"]["params"][n])


def layerwise_body(rank: int, world_size: int):
    from mcore_distill.testing import init_megatron
    from tests.optim_staged.ckpt_faults import staged_inners, train
    from tests.optim_staged.test_checkpoint_reshard import _build as build_kind

    init_megatron(tp=1, pp=1, seed=3)
    out = {}
    for residency in ("gpu", "staged"):
        model, optim = build_kind("layerwise", 3, residency=residency)
        train(model, optim, range(10 * rank, 10 * rank + 3))
        out[residency] = {"params": {n: p.detach().float().cpu().numpy().copy() for n, p in model.named_parameters()},
                          "staged": [type(x).__name__ for x in staged_inners(optim)],
                          "leaves": [type(x).__name__ for x in optim.chained_optimizers]}
    return out


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_staged_layerwise_distributed_muon_matches_native_gloo():
    """Megatron's layer-wise distributed Muon (bf16, whole matrices per DP rank, Adam in a
    byte-sharded DistributedOptimizer, buffer all-gather) on 2 gloo ranks: staged == stock,
    exactly, and the DP replicas agree."""
    r0, r1 = run_ranks(layerwise_body, 2, timeout=240)
    for r in (r0, r1):
        assert r["staged"]["leaves"] == ["LayerWiseDistributedOptimizer", "StagedDistributedOptimizer"]
        assert r["gpu"]["leaves"] == ["LayerWiseDistributedOptimizer", "DistributedOptimizer"]
        assert "StagedMuon" in r["staged"]["staged"] and "StagedAdamW" in r["staged"]["staged"]
        for name, ref in r["gpu"]["params"].items():
            np.testing.assert_array_equal(r["staged"]["params"][name], ref, err_msg=name)
    for name, ref in r0["staged"]["params"].items():
        np.testing.assert_array_equal(r1["staged"]["params"][name], ref, err_msg=name)


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_staged_muon_tp_modes_nccl_2gpu():
    """GPU lane (2 GPUs): the same comparison over NCCL with CUDA streams (TP collectives inside
    the orthogonalization run on the ring's compute stream). Newton-Schulz on GPU: 2e-3."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for layout in ("tp2_dense", "etp2_moe"):
        results = run_ranks(parallel_body, 2, layout, MODES, False, timeout=360, backend="nccl")
        _check(results, MODES, moe=LAYOUTS[layout][3] is not None, atol=2e-3, rtol=2e-3)
    results = run_ranks(parallel_body, 2, "ep2_moe", ["duplicated"], True, timeout=240, backend="nccl")
    _check(results, ["duplicated"], moe=True, atol=1e-6, rtol=1e-6)
