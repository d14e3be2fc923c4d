"""Producer process + independent student processes over one shared source (CPU, gloo, real Megatron).

The control plane runs in this process; the teacher (a real Megatron GPT) in one spawned process;
every student rank in its own process, each student in its own gloo group with its own model,
optimizer and LR. Sizes are tiny: these tests check the protocol, not throughput.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from shared_teacher import (
    CompatKey,
    NodeLimits,
    SharedTeacherSource,
    ShmStore,
    SourceConfig,
    SourceServer,
    StudentSpec,
)
from shared_teacher.refs import epoch_order, sample_id
from tests.shared_teacher import workers

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:allow_unproven_layout=True:RuntimeWarning")]

KEY = CompatKey(teacher_fingerprint="tiny-teacher-seed7", tokenizer="ids-128", signals=["logprobs", "topk"],
                top_k=4, dtype="float32", max_length=16, dataset="synthetic-v1", seed=3)


def _launch(cfg: SourceConfig, plans: dict[str, dict], out: Path, *, n_samples: int):
    """Start source + server here, the producer and every student rank as processes."""
    store = ShmStore()
    src = SharedTeacherSource(cfg, store)
    server = SourceServer(src)
    ctx = mp.get_context("spawn")
    prod_out = str(out / "producer.json")
    def rendezvous(name: str) -> str:  # a fresh file-store path per process group
        return str(out / f"{name}.{uuid.uuid4().hex}.rdzv")

    procs = {"producer": [ctx.Process(target=workers.producer_main,
                                      args=(server.connect_info, store.spec(), asdict(KEY), n_samples,
                                            rendezvous("producer"), prod_out))]}
    for spec in cfg.students:
        p = plans[spec.name]
        rdzv = rendezvous(spec.name)
        procs[spec.name] = [
            ctx.Process(target=workers.student_main,
                        args=(r, spec.world_size, rdzv, server.connect_info, store.spec(), asdict(KEY), spec.name,
                              p["hidden"], p["lr"], spec.packed, p.get("seed", 11), str(out), p.get("resume"),
                              p.get("step_limit", 0), p.get("delay", 0.0)))
            for r in range(spec.world_size)]
    for ps in procs.values():
        for proc in ps:
            proc.start()
    for spec in cfg.students:
        src.register_owned_pids(spec.name, [proc.pid for proc in procs[spec.name]])
    return src, server, store, procs, prod_out


def _shutdown(src, server, store, procs):
    for ps in procs.values():
        for proc in ps:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    server.close()
    src.close()
    store.close(remove=True)


def _producer_stats(path: str) -> dict:
    payload = json.loads(Path(path).read_text())
    assert "ok" in payload, payload.get("error")
    return payload["ok"]


def _steps(out: Path, name: str, rank: int = 0) -> list[dict]:
    rows = workers.read_log(str(out), name, rank)
    errors = [r["error"] for r in rows if "error" in r]
    assert not errors, f"{name} rank {rank} failed:\n{errors[0]}"
    return [r for r in rows if "step" in r]


def _check_hf_exports(out: Path, plans: dict) -> None:
    """Each student's exported weights load into transformers' Qwen3 with strict=True."""
    import torch
    import transformers

    for name, plan in plans.items():
        h = plan["hidden"]
        cfg = transformers.Qwen3Config(vocab_size=workers.VOCAB, hidden_size=h, intermediate_size=2 * h,
                                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=h // 4, rms_norm_eps=1e-6, tie_word_embeddings=False)
        result = transformers.Qwen3ForCausalLM(cfg).load_state_dict(
            torch.load(out / f"{name}.hf.pt", weights_only=True), strict=True)
        assert not result.missing_keys and not result.unexpected_keys, name


def _all_ids(n: int, epoch: int) -> set[str]:
    return {sample_id(epoch, i) for i in epoch_order(n, seed=KEY.seed, epoch=epoch)}


def _wait(src, procs, names, timeout, prod_out: str | None = None):
    """Until every process in ``names`` exits; fails at once on a source error or, with
    ``prod_out``, when the producer died with an error (instead of at the source's watchdog)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not p.is_alive() for n in names for p in procs[n]):
            return
        if prod_out is not None and not procs["producer"][0].is_alive() and Path(prod_out).exists():
            err = json.loads(Path(prod_out).read_text()).get("error")
            assert err is None, f"producer failed:\n{err}"
        if src.errors and not all(type(e).__name__ == "SourceTeardownBlockedError" for e in src.errors):
            raise src.errors[0]
        time.sleep(0.2)
    raise TimeoutError(f"processes {names} still running after {timeout}s; stats {src.stats()}")


@pytest.mark.timeout(420)
def test_three_students_share_one_teacher_stream(tmp_path):
    """3 students (DP=2 unpacked, DP=2 packed, DP=2 unpacked with accumulation), 2 simulated nodes."""
    n = 24
    nodes = {"n0": NodeLimits(high_samples=8, low_samples=7, high_tokens=96, low_tokens=80),
             "n1": NodeLimits(high_samples=8, low_samples=7, high_tokens=96, low_tokens=80)}
    two = {"n0": 1, "n1": 1}
    cfg = SourceConfig(key=KEY, nodes=nodes, dataset_size=n, num_epochs=1, max_sample_bytes=4096, max_seq_len=12,
                       min_seq_len=4, lease_timeout_s=20, watchdog_s=120, state_dir=str(tmp_path / "state"),
                       allow_unproven_layout=True,  # packed on two nodes: the skew bound needs ~an epoch
                       students=[StudentSpec(name="small", ranks_per_node=two, micro_batch_size=2),
                                 StudentSpec(name="packed", ranks_per_node=two, packed=True, pack_budget_tokens=24),
                                 StudentSpec(name="accum", ranks_per_node=two, micro_batch_size=1,
                                             accumulation_steps=2)])
    plans = {"small": {"hidden": 32, "lr": 1e-3}, "packed": {"hidden": 48, "lr": 3e-3},
             "accum": {"hidden": 32, "lr": 1e-2}}
    src, server, store, procs, prod_out = _launch(cfg, plans, tmp_path, n_samples=n)
    try:
        _wait(src, procs, list(procs), timeout=380, prod_out=prod_out)
        stats = _producer_stats(prod_out)
        # one teacher forward per sample, not per student
        assert stats["forward_samples"] == n and stats["teacher_sequences"] == n, stats
        everything = _all_ids(n, 0)
        for name in plans:
            ranks = [_steps(tmp_path, name, r) for r in range(2)]
            seen = [i for rank_rows in ranks for row in rank_rows for mb in row["ids"] for i in mb]
            assert len(seen) == len(set(seen)), f"{name}: duplicates {sorted(seen)}"
            dropped = everything - set(seen)
            spec = cfg.student(name)
            if spec.packed:  # only a partial last window per epoch: fewer tokens than one window per node
                data = workers.dataset(n)
                tokens = sum(len(data[int(i.split("-i")[1])]) for i in dropped)
                assert tokens < spec.quantum("n0") + spec.quantum("n1"), (name, sorted(dropped), tokens)
            else:  # 12 samples per node, windows of 2 per node: nothing dropped
                assert not dropped, f"{name}: never saw {sorted(dropped)}"
            # its own LR schedule: warm-up to its own peak LR by the third step
            assert max(r["lr"] for r in ranks[0]) == pytest.approx(plans[name]["lr"], rel=1e-12), name
            # node affinity: rank 0 reads only node n0, rank 1 only node n1
            assert all(row["nodes"] in (["n0"], []) for row in ranks[0]), name
            assert all(row["nodes"] in (["n1"], []) for row in ranks[1]), name
            done = [json.loads(line) for line in open(tmp_path / f"{name}.r0.log") if '"done"' in line]
            done1 = [json.loads(line) for line in open(tmp_path / f"{name}.r1.log") if '"done"' in line]
            # DP ranks of one student stay identical (their own group synchronizes them)
            assert done[0]["checksum"] == pytest.approx(done1[0]["checksum"], rel=1e-9, abs=1e-9), name
        assert len(_steps(tmp_path, "packed")) >= 1
        checks = {name: json.loads([line for line in open(tmp_path / f"{name}.r0.log") if '"done"' in line][0])["abs"]
                  for name in plans}
        assert len(set(checks.values())) == 3, checks  # three different models
        st = src.stats()
        assert all(s["status"] == "done" for s in st["students"].values()), st["students"]
        _check_hf_exports(tmp_path, plans)
        assert st["counters"]["freed"] == n and store.objects() == [], (st, store.objects())
        assert all(v["in_flight_samples"] == 0 and v["in_flight_bytes"] == 0 for v in st["nodes"].values())
    finally:
        _shutdown(src, server, store, procs)


@pytest.mark.timeout(600)
def test_sigkill_one_student_then_resume_from_different_checkpoints(tmp_path):
    """Phase 1: 'slow' is SIGKILLed mid-run, 'fast' stops at a step limit; the stream does not stall.
    Phase 2: restart; each student resumes from a different, older checkpoint; no gaps, no duplicates."""
    n = 12
    nodes = {"n0": NodeLimits(high_samples=6, low_samples=5)}
    students = [StudentSpec(name="fast", ranks_per_node={"n0": 1}, micro_batch_size=2),
                StudentSpec(name="slow", ranks_per_node={"n0": 1}, micro_batch_size=3)]

    def config(state: str) -> SourceConfig:
        return SourceConfig(key=KEY, nodes=nodes, students=students, dataset_size=n, num_epochs=2,
                            max_sample_bytes=4096, max_seq_len=12, min_seq_len=4, lease_timeout_s=4,
                            teardown_timeout_s=5, watchdog_s=120, state_dir=str(tmp_path / state))

    out1 = tmp_path / "phase1"
    out1.mkdir()
    cfg = config("s1")
    plans = {"fast": {"hidden": 32, "lr": 1e-3, "step_limit": 9}, "slow": {"hidden": 32, "lr": 2e-3, "delay": 0.3}}
    src, server, store, procs, prod_out = _launch(cfg, plans, out1, n_samples=n)
    try:
        deadline = time.monotonic() + 200
        while len(_steps(out1, "slow")) < 3:
            assert time.monotonic() < deadline, "slow never reached step 3"
            time.sleep(0.05)
        victim = procs["slow"][0]
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _wait(src, procs, ["fast", "producer"], timeout=200, prod_out=prod_out)
        src.wait_finished(timeout=30)
        st = src.stats()
        assert st["students"]["slow"]["status"] == "fenced", st["students"]
        assert st["students"]["fast"]["status"] == "fenced" and st["students"]["fast"]["step"] == 9
        ev = {(e, s): t for e, s, t in src.events}
        assert ev[("exit_confirmed", "slow")] >= killed_at
        assert ev[("pins_released", "slow")] >= ev[("exit_confirmed", "slow")]
        assert store.objects() == [] and all(v["in_flight_samples"] == 0 for v in st["nodes"].values()), st
        _producer_stats(prod_out)
    finally:
        _shutdown(src, server, store, procs)
    slow1 = _steps(out1, "slow")
    fast1 = _steps(out1, "fast")
    assert len(fast1) == 9 and len(slow1) >= 3

    # phase 2: fast resumes from step 7 (epoch 1), slow from step 2 (epoch 0): different checkpoints
    out2 = tmp_path / "phase2"
    out2.mkdir()
    resume = {"fast": 7, "slow": 2}
    lrs = {"fast": 1e-3, "slow": 2e-3}
    plans = {name: {"hidden": 32, "lr": lrs[name], "resume": str(out1 / f"{name}.step{k}.pt")}
             for name, k in resume.items()}
    src, server, store, procs, prod_out = _launch(config("s2"), plans, out2, n_samples=n)
    try:
        _wait(src, procs, list(procs), timeout=200, prod_out=prod_out)
        assert src.stats()["start_epoch"] == 0
        stats = _producer_stats(prod_out)
        assert stats["forward_samples"] + stats["skipped"] == 2 * n
    finally:
        _shutdown(src, server, store, procs)
    for name, k, first in (("fast", 7, fast1), ("slow", 2, slow1)):
        second = _steps(out2, name)
        lineage = [r for r in first if r["step"] <= k] + second
        assert [r["step"] for r in lineage] == list(range(1, len(lineage) + 1)), name
        # the LR schedule resumed with the checkpoint: step k+1 runs at the same LR in both phases
        assert second[0]["lr"] == pytest.approx(first[k]["lr"], rel=1e-12) and first[k]["lr"] > 0, name
        q = 2 if name == "fast" else 3
        for epoch in (0, 1):
            ids = [i for r in lineage if r["epoch"] == epoch for mb in r["ids"] for i in mb]
            assert len(ids) == len(set(ids)), f"{name} epoch {epoch}: duplicates"
            assert len(ids) == (n // q) * q, f"{name} epoch {epoch}: {len(ids)} ids, gaps"
            assert set(ids) <= _all_ids(n, epoch)
