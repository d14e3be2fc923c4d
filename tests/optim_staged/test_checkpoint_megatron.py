"""Megatron checkpoint path under faults and layout changes (issue #19 items 1-3, issue #24 items 2-3).

* kill -9 at the operations of a real ``save_checkpoint`` (1 rank, gloo): every run loads a
  complete checkpoint, the newest one whose switch happened, and the next save cleans up;
* kill -9 while ``async_save_checkpoint`` writes in the background: the previous checkpoint loads;
* a step right after ``async_save_checkpoint`` does not reach the files (snapshot);
* the recorded layout comes from the process groups, not from ``TransformerConfig``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_distill.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _session(*args: str):
    """``tests.optim_staged.ckpt_faults ARGS`` in a fresh process in its own session, output to
    ``WORK/child-….log`` (not a pipe a helper could hold open); yields ``(proc, log)`` and kills
    the whole session on exit. Megatron's save starts a helper process (the write-results queue's
    manager; it ends with its rank, see ``test_save_helper_process_ends_with_a_killed_rank``)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    log = Path(args[1]) / f"child-{args[0]}-{'-'.join(args[2:])}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.optim_staged.ckpt_faults", *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()


def _child(*args: str, timeout: float = 120) -> int:
    """Run ``tests.optim_staged.ckpt_faults`` to the end (:func:`_session`); returns the exit code
    (-9: killed as planned)."""
    with _session(*args) as (proc, log):
        proc.wait(timeout=timeout)
    if proc.returncode not in (0, -9):
        raise AssertionError(f"child {args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    return proc.returncode


def _kill_points(labels: list[str]) -> list[int]:
    """1-based kill points to try: the first and the last of every run of one kind of operation
    (each phase of the save is hit at its edges: temp folder, data files, metadata, layout record,
    fsyncs, ready rename, exchange, cleanup) plus one seeded random point; every point with
    ``MCD_KILL_ALL=1`` (72 points, about 6 s each)."""
    if os.environ.get("MCD_KILL_ALL") == "1":
        return list(range(1, len(labels) + 1))
    kinds = [lb.split(":")[0] for lb in labels]
    edges = {i + 1 for i in range(len(kinds)) if i == 0 or kinds[i] != kinds[i - 1]}
    edges |= {i + 1 for i in range(len(kinds)) if i == len(kinds) - 1 or kinds[i] != kinds[i + 1]}
    rest = sorted(set(range(1, len(labels) + 1)) - edges)
    return sorted(edges | set(random.Random(19).sample(rest, min(1, len(rest)))))


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_kill9_at_every_step_of_a_megatron_save_leaves_a_complete_checkpoint(tmp_path):
    """A 1-rank gloo job with the staged AdamW distributed optimizer saves over a complete
    checkpoint and is SIGKILLed before one of the save's file writes, fsyncs, renames, the
    directory exchange or the cleanup. The next process loads the checkpoint and it is exactly
    one of the two complete states: the old one if the kill came before the switch, else the new
    one. Saves alternate between two states so that old and new differ. Afterwards one clean
    save leaves no temporary behind (issue #19 items 1-2)."""
    assert _child("prepare", str(tmp_path), timeout=180) == 0
    labels = json.loads((tmp_path / "points.json").read_text())
    switch = next(i + 1 for i, lb in enumerate(labels)
                  if lb.startswith("_exchange:") or (lb.startswith("replace:ckpt->ckpt.old-")))
    assert any(lb.startswith("_write_item") for lb in labels) and any(lb.startswith("rmtree") for lb in labels)
    points = _kill_points(labels)
    state, expect = "A", []
    for n, k in enumerate(points):
        new = "B" if n % 2 == 0 else "A"
        assert _child("kill", str(tmp_path), str(k), new) == -9, f"kill point {k} ({labels[k - 1]}) not reached"
        # what the next process must load: the new state once the old directory was switched out
        state = new if k > switch else state
        expect.append((k, labels[k - 1], state))
    _child("verify", str(tmp_path))
    loaded = [json.loads((tmp_path / f"loaded-{k}.json").read_text()) for k in points[1:]]
    loaded.append(json.loads((tmp_path / "loaded-final.json").read_text()))
    assert json.loads((tmp_path / f"loaded-{points[0]}.json").read_text()) == "A"  # prepared
    for (k, label, want), got in zip(expect, loaded):
        assert got == want, f"after a kill before {label} (point {k}): loaded {got}, expected {want}"
    listing = json.loads((tmp_path / "listing.json").read_text())
    assert any(".tmp-" in n or ".ready-" in n or ".old-" in n for n in listing["before"]), listing
    assert listing["after"] == ["ckpt"], listing  # temporaries of the killed saves removed


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_kill9_during_async_save_background_write_keeps_previous_checkpoint(tmp_path):
    """``async_save_checkpoint`` of state B over checkpoint A; the trainer takes a step and is
    SIGKILLed while the (slowed) background writer is in the middle of B's files. A fresh process
    loads A exactly; the next save removes B's temporary (issue #24 item 3)."""
    assert _child("async-kill", str(tmp_path), timeout=180) == -9
    assert json.loads((tmp_path / "async-tmp.json").read_text()), "no background write in progress"
    _child("verify", str(tmp_path))
    assert json.loads((tmp_path / "loaded-final.json").read_text()) == "A"
    listing = json.loads((tmp_path / "listing.json").read_text())
    assert any(".tmp-" in n for n in listing["before"]) and listing["after"] == ["ckpt"], listing


# ------------------------------------------------------------------------- async, snapshot
def _muon_model(seed: int):
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all
    from optim_staged.config import AdamWConfig, MuonConfig, SlotConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer

    seed_all(seed)
    model = build_tiny_gpt(TinyGPTConfig(num_layers=1))
    model = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    cfg = StagedOptimizerConfig(algorithm="muon", muon=MuonConfig(lr=0.02), adamw=AdamWConfig(impl="foreach"),
                                slots=SlotConfig(slot_numel=1 << 14, num_slots=2))
    return model, get_staged_optimizer(cfg, [model])


def async_snapshot_body(rank: int, world_size: int, ckpt: str):
    import threading

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa

    from mcore_distill.testing import init_megatron
    from optim_staged.errors import CheckpointWriteError
    from optim_staged.megatron import async_save_checkpoint, load_checkpoint
    from tests.optim_staged.ckpt_faults import fingerprint, train

    init_megatron(tp=1, pp=1, seed=3)
    model, optim = _muon_model(3)
    train(model, optim, range(2))
    saved = fingerprint(model, optim)
    release, real = threading.Event(), fsa._write_item

    @functools.wraps(real)  # Megatron inspects _write_item's signature
    def held_write(*args, **kwargs):  # the writer waits until the next step has run
        release.wait(60)
        return real(*args, **kwargs)

    fsa._write_item = held_write
    handle = async_save_checkpoint(model, optim, ckpt, timeout_s=120)
    train(model, optim, range(2, 3))  # mutates params and staged state while the write is pending
    overlapped = not handle.done()
    try:  # a writer still running: every rank gets TimeoutError (rank 1 has nothing to write)
        handle.wait(timeout=0.2)
        timed_out = False
    except TimeoutError:
        timed_out = True
    release.set()
    handle.wait()
    after = fingerprint(model, optim)

    @functools.wraps(real)
    def failing_write(*args, **kwargs):  # a disk error in the background write of the next save
        raise OSError(28, "No space left on device")

    fsa._write_item = failing_write
    broken = async_save_checkpoint(model, optim, ckpt, timeout_s=120)
    try:
        broken.wait()
        failure = None
    except CheckpointWriteError as e:
        failure = str(e)
    fsa._write_item = real
    model2, optim2 = _muon_model(99)
    load_checkpoint(model2, optim2, ckpt)  # still the first async checkpoint
    loaded = fingerprint(model2, optim2)
    return {"overlapped": overlapped, "timed_out": timed_out, "failure": failure,
            "step_changed": [k for k in saved if not torch.equal(saved[k], after[k])],
            "mismatch": [k for k in saved if not torch.equal(saved[k], loaded[k])],
            "listing": sorted(os.listdir(os.path.dirname(ckpt)))}


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_async_save_is_a_snapshot_of_the_call(tmp_path):
    """Staged Muon chain (fp32 model: its parameters are not views, so Megatron's own staging
    does not copy them), DP=2. The step after ``async_save_checkpoint`` runs while every rank's
    writer is held; ``wait(timeout)`` raises ``TimeoutError`` on every rank meanwhile; after
    ``wait()`` the checkpoint loads into a fresh model as the state at the call, exactly (model
    parameters, masters, momenta, Adam moments, step counters). A next async save whose writer
    fails raises on every rank at ``wait()`` and leaves that checkpoint in place."""
    results = run_ranks(async_snapshot_body, 2, str(tmp_path / "ckpt"), timeout=200)
    assert results[0]["overlapped"]  # rank 0 writes the DP-replicated state (rank 1 has nothing to write)
    for r in results:
        assert r["timed_out"], "wait(timeout) returned while a writer was held"
        assert r["failure"] and "previous checkpoint there is unchanged" in r["failure"], r  # on every rank

        assert any(k.startswith("model.") for k in r["step_changed"]) and any(
            k.startswith("leaf") for k in r["step_changed"]), r["step_changed"]
        assert r["mismatch"] == [], r["mismatch"]
        assert r["listing"] == ["ckpt"]  # the failed save's temporary folder is gone


# ------------------------------------------------------------------------------- layouts
def tp_only_in_parallel_state_body(rank: int, world_size: int, ckpt: str):
    """Megatron's minimal training example sets TP=2 in parallel state only; its TransformerConfig
    keeps tensor_model_parallel_size=1. The layers follow the process groups."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, init_megatron, seed_all
    from optim_staged import CheckpointLayoutError
    from optim_staged.config import AdamWConfig, SlotConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer, load_checkpoint, save_checkpoint
    from tests.optim_staged.ckpt_faults import train

    def build(seed):
        seed_all(seed)
        model = build_tiny_gpt(TinyGPTConfig(num_layers=1))  # config TP=1
        model = DDP(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        cfg = StagedOptimizerConfig(adamw=AdamWConfig(impl="foreach"), slots=SlotConfig(slot_numel=4096))
        return model, get_staged_optimizer(cfg, [model])

    init_megatron(tp=2, pp=1, seed=3)
    model, optim = build(3)
    out = {"config_tp": model.config.tensor_model_parallel_size,
           "qkv_shape": tuple(dict(model.named_parameters())["module.decoder.layers.0.self_attention.linear_qkv.weight"].shape)}
    train(model, optim, range(1))
    save_checkpoint(model, optim, ckpt)
    out["files"] = sorted(os.listdir(ckpt))
    out["layout"] = json.loads(open(os.path.join(ckpt, "optim_staged_layout.json")).read())
    parallel_state.destroy_model_parallel()
    init_megatron(tp=1, pp=1, seed=3)  # the same 2 ranks at TP=1, DP=2
    model, optim = build(5)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        load_checkpoint(model, optim, ckpt)
        out["error"] = None
    except CheckpointLayoutError as e:
        out["error"] = str(e)
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return out


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_layout_recorded_from_parallel_state_not_transformer_config(tmp_path):
    """Before the fix the record said TP=1 (from TransformerConfig) and the load at TP=1 was not
    refused (issue #19 item 3)."""
    for r in run_ranks(tp_only_in_parallel_state_body, 2, str(tmp_path / "ckpt"), timeout=200):
        assert r["config_tp"] == 1 and r["qkv_shape"][0] == (4 + 2 * 2) * 16 // 2  # QKV rows sharded over TP=2
        assert r["layout"]["tensor_model_parallel_size"] == 2 and r["layout"]["data_parallel_size"] == 1
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(r["files"])  # both ranks wrote into one temp folder
        assert r["error"] is not None, "TP=2 checkpoint loaded at TP=1 without an error"
        assert "tensor_model_parallel_size=2" in r["error"] and "tensor_model_parallel_size=1" in r["error"]
        assert "saved layout: TP=2" in r["error"] and "this run: TP=1" in r["error"]
        assert r["untouched"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_save_helper_process_ends_with_a_killed_rank(tmp_path):
    """Megatron's ``torch_dist`` save spawns a process-wide manager for its write-results queue;
    a rank SIGKILLed after a save (preemption) left that server running as an orphan (a spawned
    interpreter, ~0.7 GB with torch imported). ``save_checkpoint`` now creates the queue on a
    manager that watches its parent: killing the rank alone (not its session) ends it within a
    few poll intervals."""
    import signal
    import time

    from tests._procs import gone_within

    with _session("helpers", str(tmp_path)) as (proc, log):
        deadline = time.monotonic() + 240
        while not (tmp_path / "helpers.json").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the child did not save in time"
            time.sleep(0.2)
        time.sleep(0.2)  # the file is written in one call; let it land
        helpers = json.loads((tmp_path / "helpers.json").read_text())
        assert helpers, "the save started no helper process (Megatron's writer changed?)"
        os.kill(proc.pid, signal.SIGKILL)  # the rank only, as a preemption would
        proc.wait(timeout=30)
        left = gone_within(helpers, 10)
        assert not left, f"helper processes {left} outlived the SIGKILLed rank by 10 s"
