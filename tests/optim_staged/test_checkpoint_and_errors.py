"""Atomic writes, model-space state, and typed errors for unsupported Megatron configs."""

from __future__ import annotations

import os

import pytest
import torch

from optim_staged import SlotConfig, StagedAdamW, StagedConfigError, StagedOptimizerConfig
from optim_staged.checkpoint import atomic_torch_save, model_space_state, publish_directory


def test_atomic_torch_save_roundtrip_and_model_space(tmp_path):
    p = torch.randn(4, 5, requires_grad=True)
    opt = StagedAdamW([p], slots=SlotConfig(slot_numel=1024))
    p.grad = torch.ones_like(p)
    opt.step()
    state = model_space_state(opt, {id(p): "w"})
    assert set(state["w"]) == {"master_param", "exp_avg", "exp_avg_sq", "step"} and state["w"]["step"] == 1
    assert state["w"]["exp_avg"].shape == (4, 5)
    path = tmp_path / "opt.pt"
    atomic_torch_save(state, path)
    atomic_torch_save(state, path)  # overwrite in place
    assert sorted(os.listdir(tmp_path)) == ["opt.pt"]  # no temp files left behind
    back = torch.load(path)
    assert torch.equal(back["w"]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_publish_directory_replaces_only_when_complete(tmp_path):
    final, tmp = tmp_path / "ckpt", tmp_path / "ckpt.tmp"
    final.mkdir()
    (final / "old").write_text("old")
    tmp.mkdir()
    (tmp / "new").write_text("new")
    publish_directory(tmp, final)
    assert sorted(os.listdir(final)) == ["new"] and sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("field,kwargs,match", [
    ("fp16", dict(fp16=True, bf16=False), "fp16"),
    ("optimizer_cpu_offload", dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True),
     "optimizer_cpu_offload"),
    ("optimizer_cuda_graph", dict(optimizer_cuda_graph=True), "optimizer_cuda_graph"),
    ("sgd", dict(optimizer="sgd"), "optimizer='sgd'"),
    ("no distopt", dict(use_distributed_optimizer=False), "use_distributed_optimizer=False"),
])
def test_unsupported_megatron_configs_raise_typed_errors(field, kwargs, match):
    from megatron.core.optimizer import OptimizerConfig

    from optim_staged import UnsupportedMegatronConfigError
    from optim_staged.megatron import get_staged_optimizer

    base = dict(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, bf16=True)
    base.update(kwargs)
    try:
        mcfg = OptimizerConfig(**base)
    except (AssertionError, RuntimeError, ValueError):  # Megatron itself rejects it without TE
        pytest.skip(f"Megatron's OptimizerConfig refuses {field} on this install before we see it")
    with pytest.raises(UnsupportedMegatronConfigError, match=match):
        get_staged_optimizer(StagedOptimizerConfig(), [], megatron_config=mcfg)


def test_config_validation_names_field_and_value():
    with pytest.raises(StagedConfigError, match=r"StagedOptimizerConfig\.algorithm must be one of \['adamw', 'muon'\], got 'sgd'"):
        StagedOptimizerConfig(algorithm="sgd")
    with pytest.raises(StagedConfigError, match=r"StagedOptimizerConfig\.residency must be one of \['gpu', 'staged'\], got 'cpu'"):
        StagedOptimizerConfig(residency="cpu")
    with pytest.raises(StagedConfigError, match=r"num_slots=0"):
        SlotConfig(num_slots=0)


def test_hydra_structured_config():
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(StagedOptimizerConfig)
    cfg.algorithm = "muon"
    cfg.slots.num_slots = 3
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, StagedOptimizerConfig) and obj.slots.num_slots == 3 and obj.algorithm == "muon"


def test_layout_check_refuses_tp_pp_ep_changes_and_unknown_checkpoints(tmp_path):
    from optim_staged import CheckpointLayoutError
    from optim_staged.checkpoint import LAYOUT_FILE, LAYOUT_FIXED, check_layout, parallel_layout, write_layout

    saved = parallel_layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                            context_parallel_size=1, data_parallel_size=4, expert_data_parallel_size=4)
    write_layout(tmp_path, saved)
    assert sorted(os.listdir(tmp_path)) == [LAYOUT_FILE]
    same_but_dp = dict(saved, data_parallel_size=1, context_parallel_size=2, expert_data_parallel_size=2)
    assert check_layout(tmp_path, same_but_dp) == saved  # DP and CP may change
    for field in LAYOUT_FIXED:
        other = dict(saved, **{field: saved[field] * 2})
        with pytest.raises(CheckpointLayoutError, match=rf"saved with {field}={saved[field]}, this run has "
                                                        rf"{field}={saved[field] * 2}") as err:
            check_layout(tmp_path, other)
        assert "saved layout: TP=2 PP=2 EP=2 ETP=1 CP=1 DP=4 EDP=4" in str(err.value)  # both layouts named
    with pytest.raises(CheckpointLayoutError, match="not written by"):
        check_layout(tmp_path / "missing", saved)
    write_layout(tmp_path, dict(saved, format=99))
    with pytest.raises(CheckpointLayoutError, match="format=99"):
        check_layout(tmp_path, saved)
    # a format-1 record (TP/PP/EP/DP only) is still read; the fields it lacks are not compared
    write_layout(tmp_path, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                            "expert_model_parallel_size": 2, "data_parallel_size": 4, "format": 1})
    assert check_layout(tmp_path, dict(saved, expert_tensor_parallel_size=2))["format"] == 1
    with pytest.raises(CheckpointLayoutError, match="layout field 'tp'"):
        parallel_layout(tp=2)
    with pytest.raises(CheckpointLayoutError, match="data_parallel_size=0"):
        parallel_layout(data_parallel_size=0)


@pytest.mark.parametrize("mode", ["fence", "snapshot"])
def test_async_save_holds_state_of_the_call(tmp_path, monkeypatch, mode):
    """The writer is slowed down; the step right after async_save must not leak into the file.
    fence: the step waits for the write; snapshot: the step runs while the copy is written."""
    import threading
    import time

    from optim_staged import checkpoint

    real = checkpoint.atomic_torch_save
    release = threading.Event()

    def slow(obj, path):
        release.wait(10)
        time.sleep(0.05)  # let a step that ignored the fence mutate the slabs before the write
        real(obj, path)

    monkeypatch.setattr(checkpoint, "atomic_torch_save", slow)
    g = torch.Generator().manual_seed(8)
    ps = [torch.randn(s, generator=g, requires_grad=True) for s in [(33, 7), (1500,)]]
    opt = StagedAdamW(ps, lr=1e-2, slots=SlotConfig(slot_numel=1024, num_slots=2))
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    names = {id(p): f"p{i}" for i, p in enumerate(ps)}
    expect = checkpoint.model_space_state(opt, names)
    handle = checkpoint.async_save(opt, names, tmp_path / "opt.pt", mode=mode, timeout_s=20)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    if mode == "fence":
        threading.Timer(0.2, release.set).start()
        opt.step()  # blocks on the fence until the write is done
        assert handle.done()
    else:
        opt.step()  # runs on at once; the writer holds its own copy
        assert not handle.done()
        release.set()
    handle.wait()
    saved = torch.load(tmp_path / "opt.pt")
    opt.drain(release=False)
    for name, st in expect.items():
        assert saved[name]["step"] == st["step"] == 2
        for k in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[name][k], st[k]), f"{name}.{k}"
    assert not torch.equal(opt.state[ps[0]]["exp_avg"], expect["p0"]["exp_avg"])  # the step did run after
    with pytest.raises(ValueError, match="mode='copy'"):
        checkpoint.async_save(opt, names, tmp_path / "x.pt", mode="copy")


def test_async_save_removes_temporaries_of_killed_writers(tmp_path):
    """A save killed mid-write leaves ``.<name>.tmp-<token>``; the next save deletes it (not the
    temporary of a live writer on this host). Issue #19 item 2."""
    from optim_staged import checkpoint

    dead = tmp_path / ".opt.pt.tmp-1-otherhost-12345"
    dead.write_bytes(b"partial")
    p = torch.randn(3, requires_grad=True)
    opt = StagedAdamW([p], slots=SlotConfig(slot_numel=1024))
    checkpoint.async_save(opt, {id(p): "p"}, tmp_path / "opt.pt", mode="snapshot").wait()
    assert sorted(os.listdir(tmp_path)) == ["opt.pt"]

