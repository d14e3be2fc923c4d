"""Hydra configs of the real-architecture runner: every model config composes and validates, the
parameter estimate equals the built model, published model sizes are reproduced, wrong keys are
Hydra errors naming the key, and the tiny configs run MOPD steps on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.train.config import ArchConfig, RunConfig, TrainConfig, TrainConfigError, WorkloadConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "examples" / "configs"
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
TINY = ["tiny_dense", "tiny_moe", "tiny_hybrid"]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # the schema was registered by importing examples.train.config
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _cfg(overrides: list[str]) -> TrainConfig:
    from examples.train.config import to_train_config

    cfg = to_train_config(_compose(overrides))
    assert isinstance(cfg, TrainConfig)
    return cfg


def test_all_model_configs_listed():
    assert set(TINY) | {"qwen3_dense_0p6b", "qwen3_dense_1p7b", "qwen3_dense_8b", "qwen3_moe_30b_a3b",
                        "qwen3_moe_small", "qwen3_next_hybrid_small"} == set(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_every_config_composes_and_validates(name):
    cfg = _cfg([f"model={name}"])
    cfg.validate()
    assert cfg.model.name == name


def test_default_is_cpu_tiny_and_yaml_equals_dataclass_defaults():
    from dataclasses import asdict

    cfg = _cfg([])
    assert cfg.model.name == "tiny_dense" and cfg.model.params_dtype == "float32"
    assert asdict(cfg.workload) == asdict(WorkloadConfig()) and asdict(cfg.run) == asdict(RunConfig())


@pytest.mark.parametrize("name,published", [
    ("qwen3_dense_0p6b", 0.596e9),     # Qwen3-0.6B: 596,049,920 (tied embeddings)
    ("qwen3_dense_8b", 8.191e9),       # Qwen3-8B: 8,190,735,360
    ("qwen3_moe_30b_a3b", 30.532e9),   # Qwen3-30B-A3B: 30,532,122,624
])
def test_published_sizes(name, published):
    from examples.train.runner import param_count

    n = param_count(_cfg([f"model={name}"]).model)
    assert abs(n - published) / published < 1e-3, (name, n)


@pytest.mark.parametrize("overrides,key", [
    (["model.hiden_size=8"], "hiden_size"),
    (["run.stepz=2"], "stepz"),
    (["model=qwen3_dense_0p6bb"], "qwen3_dense_0p6bb"),
])
def test_wrong_keys_are_hydra_errors_naming_the_key(overrides, key):
    from hydra.errors import HydraException

    with pytest.raises(HydraException, match=key):
        _compose(overrides)


def test_appended_unknown_key_fails_when_built():
    """``+key=`` passes composition (Hydra adds it); ``to_train_config`` refuses it by name."""
    with pytest.raises(TrainConfigError, match="'model.bogus': ArchConfig has no field 'bogus'; valid keys: "):
        _cfg(["+model.bogus=1"])


@pytest.mark.parametrize("field,value,cfg", [
    ("model.layer_pattern", "GGA", TrainConfig(model=ArchConfig(num_layers=4, layer_pattern="GGA"))),
    ("model.num_moe_experts", 4, TrainConfig(model=ArchConfig(num_layers=2, layer_pattern="GA", num_moe_experts=4, moe_router_topk=2))),
    ("model.params_dtype", "fp8", TrainConfig(model=ArchConfig(params_dtype="fp8"))),
    ("model.max_sequence_length", 64, TrainConfig(model=ArchConfig(max_sequence_length=64))),
    ("run.residency", "host", TrainConfig(run=RunConfig(residency="host"))),
    ("workload.response_jitter", 300, TrainConfig(workload=WorkloadConfig(response_jitter=300))),
])
def test_bad_values_name_field_and_value(field, value, cfg):
    with pytest.raises(TrainConfigError, match=rf"{field}={value!r}"):
        cfg.validate()


def test_response_mask_layout():
    from examples.train.runner import response_mask
    from harts import build_forest, sequence_logprobs

    seqs = [[5, 6, 7, 8, 9], [5, 6, 7, 1], [5, 6, 2, 3, 4, 4]]
    mask = response_mask(seqs, prompt_len=3)
    forest = build_forest(seqs)
    tokens = sequence_logprobs(forest.tokens.double(), forest)  # node value = its token → predicted token
    expect = torch.cat([torch.tensor(s[1:]) for s in seqs])
    assert torch.equal(tokens.long(), expect)
    pos = torch.cat([torch.arange(1, len(s)) for s in seqs])
    assert torch.equal(mask, pos >= 3) and int(mask.sum()) == 2 + 1 + 3


@pytest.mark.timeout(120)
def test_tiny_configs_build_and_step_on_cpu(cpu_megatron):
    from examples.train.runner import build_model, param_count, response_mask, run
    from harts import build_forest, sequence_logprobs
    from harts.megatron import make_tree_params, tree_forward

    small = ["workload.num_groups=2", "workload.group_size=3", "workload.prompt_len=6", "workload.response_len=5",
             "run.steps=2", "run.device=cpu"]
    for name in TINY:
        cfg = _cfg([f"model={name}", *small])
        model = build_model(cfg.model, seed=3, device=torch.device("cpu"))
        assert sum(p.numel() for p in model.parameters()) == param_count(cfg.model), name
        # tree log-probs of the built model equal an unpacked per-sequence forward (fp32)
        seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 7]]
        forest = build_forest(seqs)
        with torch.no_grad():
            params = make_tree_params(forest, backend="dense", model=model)  # GDN plans for the hybrid
            tree = sequence_logprobs(tree_forward(model, forest, params=params)[0], forest)
            ref = []
            for s in seqs:
                ids = torch.tensor([s])
                logits = model(ids, torch.arange(len(s))[None], None).float()
                ref.append(torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0])
        torch.testing.assert_close(tree, torch.cat(ref), atol=2e-5, rtol=0)
        res = run(cfg)
        assert res["params"] == param_count(cfg.model)
        steps = res["steps"]
        assert len(steps) == 2 and all(torch.isfinite(torch.tensor(x["loss"])) for x in steps)
        # on-policy (ρ = 1) with unclipped advantages the loss is the sampled reverse KL estimate
        for x in steps:
            assert abs(x["loss"] - x["sampled_kl"]) < 1e-5, (name, x)
            assert x["tokens"] == 6 * 11 and x["tree_tokens"] < x["tokens"]
        mask = response_mask([[0] * 11] * 6, 6)
        assert int(mask.sum()) == 6 * 5


@pytest.mark.timeout(120)
def test_agent_workload_through_the_runner(cpu_megatron):
    from examples.train.runner import make_rollouts, run

    cfg = _cfg(["workload.kind=agent", "workload.num_groups=2", "workload.group_size=2", "run.steps=1",
                "run.device=cpu"])
    seqs, mask, rewards = make_rollouts(cfg, step=0)
    assert len(seqs) == 4 and len(rewards) == 4 and mask.numel() == sum(len(s) - 1 for s in seqs)
    res = run(cfg)
    x = res["steps"][0]
    assert x["tokens"] == sum(map(len, seqs)) and x["reward"] == sum(rewards) / 4
    assert abs(x["loss"] - x["sampled_kl"]) < 1e-5
    with pytest.raises(TrainConfigError, match="workload.kind='tree'"):
        _cfg(["workload.kind=tree"])


def _scaled_down(name: str) -> list[str]:
    """Overrides that shrink a GPU config to CPU size while keeping its structure (tied embeddings,
    GQA ratio, explicit head dim, MoE top-k routing, hybrid pattern)."""
    arch = _cfg([f"model={name}"]).model
    out = [f"model={name}", "model.vocab_size=512", "model.hidden_size=64", "model.ffn_hidden_size=96",
           "model.kv_channels=16", "model.params_dtype=float32", "model.recompute=false"]
    if arch.num_moe_experts:
        out += ["model.num_layers=2", "model.num_moe_experts=8", "model.moe_ffn_hidden_size=32"]
    elif arch.layer_pattern:
        out += ["model.num_layers=4", "model.layer_pattern=GGGA", "model.linear_key_head_dim=16",
                "model.linear_value_head_dim=16", "model.linear_num_key_heads=2", "model.linear_num_value_heads=4"]
    else:
        out += ["model.num_layers=2"]
    return out + ["workload.num_groups=2", "workload.group_size=2", "workload.prompt_len=5", "workload.response_len=4",
                  "run.steps=1", "run.device=cpu"]


@pytest.mark.timeout(120)
def test_gpu_configs_scaled_down_by_overrides_step_on_cpu(cpu_megatron):
    from examples.train.runner import param_count, run

    for name in ("qwen3_dense_0p6b", "qwen3_moe_small", "qwen3_next_hybrid_small"):
        cfg = _cfg(_scaled_down(name))
        full = _cfg([f"model={name}"]).model
        assert (cfg.model.tie_embeddings, cfg.model.num_attention_heads, cfg.model.num_query_groups,
                cfg.model.moe_router_topk) == (full.tie_embeddings, full.num_attention_heads, full.num_query_groups,
                                               full.moe_router_topk)
        res = run(cfg)
        assert res["params"] == param_count(cfg.model)
        x = res["steps"][0]
        assert abs(x["loss"] - x["sampled_kl"]) < 1e-5 and x["tree_tokens"] < x["tokens"]


def test_one_gpu_memory_check_names_model_and_sizes():
    from examples.train.runner import DeviceMemoryError, check_fits, estimate_bytes

    gib = 2**30
    h200_free, h200_total = 139 * gib, 140 * gib
    for name in ("qwen3_dense_0p6b", "qwen3_dense_1p7b", "qwen3_dense_8b", "qwen3_moe_small", "qwen3_next_hybrid_small"):
        cfg = _cfg([f"model={name}"])
        check_fits(cfg, need=estimate_bytes(cfg.model, residency="staged"), free=h200_free, total=h200_total)
    big = _cfg(["model=qwen3_moe_30b_a3b"])
    need = estimate_bytes(big.model, residency="staged")
    assert need == 30_532_122_624 * (2 * 2 + 4)  # bf16 student + teacher, fp32 grads
    with pytest.raises(DeviceMemoryError, match=r"model=qwen3_moe_30b_a3b: about 227\.5 GiB .* 139\.0 of 140\.0 GiB"):
        check_fits(big, need=need, free=h200_free, total=h200_total)
    eight = _cfg(["model=qwen3_dense_8b", "run.residency=gpu"])  # + fp32 master and moments on the device
    with pytest.raises(DeviceMemoryError, match="fp32 optimizer state"):
        check_fits(eight, need=estimate_bytes(eight.model, residency="gpu"), free=h200_free, total=h200_total)
