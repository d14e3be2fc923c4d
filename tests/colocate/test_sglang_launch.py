"""An SGLang server started by ``SGLangEngine.launch_server`` is a colocated worker of its owner:
guarded (killed with it, also when the owner is SIGKILLed), with the role's environment
(Megatron hidden, allocator settings removed) and its GPUs mapped through the owner's
``CUDA_VISIBLE_DEVICES`` with ``base_gpu_id`` 0. On CPU the server is
``tests/colocate/_contract_server.py`` (SGLang's HTTP contract over a transformers model, loaded
from the checkpoint at ``--model-path`` as SGLang would); the real server runs on the GPU lane
(``test_sglang_http.py::test_real_sglang_http_server``)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from colocate import PublishConfig, Publisher, PublishError, SGLangEngine
from colocate.errors import ConfigError
from colocate.sglang_clients import engine_devices
from colocate.sglang_engine import hide_megatron_dir, write_hf_checkpoint
from colocate.workers import LocalScheduler
from tests._procs import group_gone

from ._contract_server import SPEC, sha, weights
from .test_workers import _gone

ROOT = Path(__file__).resolve().parents[2]
SERVER = "tests.colocate._contract_server"


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


# what torchrun --standalone (torch 2.11) sets for its worker processes (a subset)
TORCHRUN_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29511",
                 "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "r1"}

_TCP_GROUP = """
import socket, sys
from datetime import timedelta
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
# how SGLang 0.5.17's scheduler joins its own group (srt/distributed/bootstrap.py: a tcp:// init method)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                        timeout=timedelta(seconds=float(sys.argv[1])))
print("joined", flush=True)
"""


@pytest.mark.timeout(120)
def test_sglang_processes_lose_the_torchrun_rank_env_that_blocks_their_rendezvous():
    """Under a torchrun owner, ``TORCHELASTIC_USE_AGENT_STORE=True`` makes torch's ``tcp://``
    rendezvous a client of a store nobody hosts: a one-process group as SGLang's schedulers
    create theirs does not form (it fails at the deadline; SGLang leaves torch's default, 10+
    minutes). The environment every SGLang process of ours gets (:func:`sglang_env_overrides`
    over the owner's) has none of the launcher's per-rank variables, and the same group forms."""
    from colocate.sglang_clients import LAUNCHER_ENV, sglang_env_overrides
    from colocate.workers import merge_env

    owner = _env(**TORCHRUN_RANK, TORCHELASTIC_ERROR_FILE="/tmp/err.json", MCD_KEEP="1")
    over = sglang_env_overrides(owner, {"MCD_ROLE_VAR": "role"}, hide_megatron=False)
    child = merge_env(owner, {k: "" if v is None else v for k, v in over.items()})
    assert not [k for k in child if k in LAUNCHER_ENV or k.startswith("TORCHELASTIC_")]
    assert child["MCD_KEEP"] == "1" and child["MCD_ROLE_VAR"] == "role" and child["PYTHONPATH"] == owner["PYTHONPATH"]
    assert sglang_env_overrides(owner, hide_megatron=True)["PYTHONPATH"].split(os.pathsep)[0] == hide_megatron_dir()

    ok = subprocess.run([sys.executable, "-c", _TCP_GROUP, "30"], env=child, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "joined" in ok.stdout, ok.stderr[-2000:]
    stuck = subprocess.run([sys.executable, "-c", _TCP_GROUP, "1"], env=owner, capture_output=True, text=True,
                           timeout=60)
    assert stuck.returncode != 0 and "joined" not in stuck.stdout
    assert "timed out" in stuck.stderr or "Timeout" in stuck.stderr, stuck.stderr[-2000:]


def test_engine_devices_map_owner_gpus_and_zero_the_base():
    args = {"tp_size": 2, "base_gpu_id": 1}
    assert engine_devices(args, None) == [1, 2] and args == {"tp_size": 2, "base_gpu_id": 0}
    args = {"tp_size": 1}
    assert engine_devices(args, [3]) == [3] and args["base_gpu_id"] == 0
    assert engine_devices({"tp_size": 2}, None) is None  # neither: the server sees the owner's devices
    with pytest.raises(ConfigError, match="not both"):
        engine_devices({"base_gpu_id": 2}, [0])
    with pytest.raises(ConfigError, match="fewer than tp_size·dp_size=4"):
        engine_devices({"tp_size": 2, "dp_size": 2}, [0, 1])


@pytest.mark.timeout(240)
def test_launch_server_runs_as_a_guarded_worker_with_the_role_env(tmp_path):
    write_hf_checkpoint(tmp_path / "ckpt", weights(1), spec=SPEC, dtype=torch.float32)
    sched = LocalScheduler(owner_env=_env(CUDA_VISIBLE_DEVICES="4,5,6,7", MCD_ROLE_VAR="owner",
                                          PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", **TORCHRUN_RANK))
    eng = SGLangEngine.launch_server(spec=SPEC, param_dtype=torch.float32, scheduler=sched, ipc="cpu", devices=[2],
                                     env={"PYTORCH_CUDA_ALLOC_CONF": None, "MCD_ROLE_VAR": "role", "MASTER_ADDR": "10.0.0.9",
                                          "MCD_MP_AUTHKEY": multiprocessing.current_process().authkey.hex()},
                                     log_path=str(tmp_path / "server.log"), start_timeout_s=180, server_module=SERVER,
                                     model_path=str(tmp_path / "ckpt"), tp_size=1)
    try:
        p = eng.client.get("/probe")
        argv, env = p["argv"], p["env"]
        assert env["CUDA_VISIBLE_DEVICES"] == "6"  # the owner's logical 2
        assert argv[argv.index("--base-gpu-id") + 1] == "0" and argv[argv.index("--tp-size") + 1] == "1"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] is None and env["MCD_ROLE_VAR"] == "role"
        # the owner's torchrun rank variables are gone; a role override puts one back
        assert all(env[k] is None for k in TORCHRUN_RANK if k != "MASTER_ADDR") and env["MASTER_ADDR"] == "10.0.0.9"
        assert env["COLOCATE_ROLE"] == "rollout" and env["PYTHONPATH"].split(os.pathsep)[0] == hide_megatron_dir()
        assert p["megatron"].startswith("ImportError: megatron is hidden")
        assert p["ppid"] == eng.client.worker.pid and eng.client.worker in sched.workers  # under the guard
        assert eng.residency.allocator == "default"  # the server's settings, not the owner's
        assert eng.checksum() == sha(weights(1))  # loaded from --model-path
        w = weights(2)
        Publisher(eng, PublishConfig(bucket_bytes=16 << 10)).publish(w, version=1)
        assert eng.weight_version() == 1 and eng.checksum() == sha(w)
    finally:
        eng.shutdown()
    assert _gone(p["pid"]) and not sched.workers[0].alive()


@pytest.mark.timeout(240)
def test_launched_server_dies_with_its_killed_owner(tmp_path):
    write_hf_checkpoint(tmp_path / "ckpt", weights(1), spec=SPEC, dtype=torch.float32)
    out = subprocess.run([sys.executable, "-m", "tests.colocate._server_owner", str(tmp_path / "ckpt"),
                          str(tmp_path / "server.log")], env=_env(), capture_output=True, text=True, timeout=200,
                         cwd=ROOT)
    assert out.returncode == -9, out.stderr[-3000:]
    server, guard = (int(x) for x in out.stdout.split())
    assert _gone(guard, timeout=20) and _gone(server, timeout=20), "the SGLang server outlived its owner"


@pytest.mark.timeout(240)
def test_config_launch_sets_the_role_env_and_the_teacher_owns_its_server(tmp_path):
    """A teacher served by a second SGLang server, started from :class:`SGLangServerConfig`
    through ``colocate.workers``: the role's environment (memory-saver graphs, the configured
    allocator settings replacing the owner's, offline hub, role name), the server arguments;
    mopd's ``HTTPTeacher`` scores against it (log-probs equal to the model's own); closing the
    teacher's pool kills the server's whole process group (no orphan)."""
    from colocate.config import SGLangServerConfig
    from colocate.engines import build_hf_model, hf_checkpoint_views
    from mopd.backends import HTTPTeacher, TokenBatch
    from mopd.config import RoutingSpec, TeacherPoolConfig
    from mopd.routing import score_routed
    from mopd.teachers import TeacherPool

    w = weights(3)
    write_hf_checkpoint(tmp_path / "teacher", w, spec=SPEC, dtype=torch.float32)
    sched = LocalScheduler(owner_env=_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
                                          PYTORCH_ALLOC_CONF="expandable_segments:True"))
    cfg = SGLangServerConfig(model_path=str(tmp_path / "teacher"), role="teacher",
                             alloc_conf="garbage_collection_threshold:0.8", log_path=str(tmp_path / "teacher.log"),
                             start_timeout_s=180, request_timeout_s=60, env={"MCD_ROLE_VAR": "teacher"})
    eng = SGLangEngine.launch_server(cfg, spec=SPEC, param_dtype=torch.float32, scheduler=sched, ipc="cpu",
                                     server_module=SERVER)
    teacher = HTTPTeacher("big", eng.client.base_url, timeout_s=60, max_retries=0, vocab_size=SPEC.vocab_size,
                          server=eng)
    pool = TeacherPool({"big": teacher}, config=TeacherPoolConfig(wait_timeout_s=120.0))
    try:
        p = eng.client.get("/probe")
        env, argv = p["env"], p["argv"]
        assert env["COLOCATE_ROLE"] == "teacher" and env["MCD_ROLE_VAR"] == "teacher"
        assert env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1" and env["HF_HUB_OFFLINE"] == "1"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.8" and env["PYTORCH_ALLOC_CONF"] is None
        assert eng.residency.allocator == "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8"
        assert "--enable-memory-saver" in argv and argv[argv.index("--cuda-graph-bs-decode") + 1:][:3] == ["1", "2", "4"]
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.3" and p["ppid"] == eng.client.worker.pid

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, SPEC.vocab_size, (3, 12), generator=g)
        ids[1, 5] = SPEC.vocab_size - 1
        batch = TokenBatch(ids, torch.tensor([12, 9, 7]), torch.tensor([0, 2, 1]))
        targets, _ = score_routed(pool, batch, ["r"] * 3, RoutingSpec(routes={"r": {"big": 1.0}}))
        ref = build_hf_model(SPEC)
        views = hf_checkpoint_views(ref)
        with torch.no_grad():
            for n, t in w.items():
                views[n].copy_(t)
            lp = torch.log_softmax(ref(input_ids=ids).logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = batch.label_mask()[:, :-1]
        got = targets.logp_sum[:, :-1]
        assert mask.sum() > 10 and (got - lp).abs()[mask].max().item() <= 1e-5
    finally:
        pool.close()
    assert teacher.server is None and _gone(p["pid"]) and not sched.workers[0].alive()


@pytest.mark.timeout(120)
def test_start_failure_is_typed_and_leaves_no_process(tmp_path):
    """A server that cannot start (no checkpoint at ``model_path``) exits during start:
    ``EngineStartError`` (a ``ReceiverDied``) naming the log, raised before the start deadline, and its process group is gone."""
    from colocate.config import SGLangServerConfig
    from colocate.errors import EngineStartError

    sched = LocalScheduler(owner_env=_env())
    cfg = SGLangServerConfig(model_path=str(tmp_path / "missing"), log_path=str(tmp_path / "server.log"),
                             start_timeout_s=100)
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match="exited during start") as ei:
        SGLangEngine.launch_server(cfg, spec=SPEC, param_dtype=torch.float32, scheduler=sched, ipc="cpu",
                                   server_module=SERVER)
    assert time.monotonic() - t0 < 90
    assert "line(s) of the log:" in str(ei.value) and "missing" in str(ei.value)  # the log's tail names the cause
    (worker,) = sched.workers
    assert not worker.alive() and group_gone(worker.pid)
    assert "missing" in (tmp_path / "server.log").read_text()  # the cause is in the log


@pytest.mark.timeout(120)
def test_slow_start_logs_a_heartbeat_and_the_timeout_carries_the_log_tail(tmp_path, monkeypatch, caplog):
    """A server that does not answer ``/health``: a WARNING every heartbeat with the elapsed
    time and the last line of its log, then ``ReceiverTimeout`` at ``start_timeout_s`` with the
    log's last lines, and its process group killed."""
    import logging

    from colocate import sglang_clients
    from colocate.errors import ReceiverTimeout
    from colocate.sglang_clients import HTTPClient

    monkeypatch.setattr(sglang_clients, "HEARTBEAT_S", 0.5)
    sched = LocalScheduler(owner_env=_env())
    with caplog.at_level(logging.WARNING, logger="colocate.sglang_clients"), \
            pytest.raises(ReceiverTimeout, match=r"not healthy within 3s.*last 1 line\(s\) of the log:\n  \| loading "
                                                 r"weights: shard 3 of 7"):
        HTTPClient.launch(server_module="tests.colocate._stuck_server", scheduler=sched, ipc="cpu", start_timeout_s=3,
                          log_path=str(tmp_path / "stuck.log"), model_path="/m")
    beats = [r.getMessage() for r in caplog.records if "waiting for /health" in r.getMessage()]
    assert beats and all("log's last line: loading weights: shard 3 of 7" in b for b in beats), beats
    (worker,) = sched.workers
    assert not worker.alive() and group_gone(worker.pid)


@pytest.mark.timeout(180)
def test_engine_crash_mid_generate_is_typed_and_in_time(tmp_path):
    """The server process dies while a generation is in flight: ``generate`` raises
    ``ReceiverDied`` at once (not at the request deadline), a publish afterwards fails typed and
    poisons its version, and the owner's shutdown leaves no process of the group."""
    from colocate.config import SGLangServerConfig
    from colocate.errors import ReceiverDied

    write_hf_checkpoint(tmp_path / "ckpt", weights(1), spec=SPEC, dtype=torch.float32)
    sched = LocalScheduler(owner_env=_env(MCD_MP_AUTHKEY=multiprocessing.current_process().authkey.hex()))
    cfg = SGLangServerConfig(model_path=str(tmp_path / "ckpt"), log_path=str(tmp_path / "server.log"),
                             start_timeout_s=150, request_timeout_s=60)
    eng = SGLangEngine.launch_server(cfg, spec=SPEC, param_dtype=torch.float32, scheduler=sched, ipc="cpu",
                                     server_module=SERVER, generate_delay_s=30)
    try:
        pid = eng.client.get("/probe")["pid"]
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(ReceiverDied):
            eng.generate([[1, 2, 3]], max_new_tokens=2)
        assert time.monotonic() - t0 < 20  # the request deadline is 60 s, the generation 30 s
        pub = Publisher(eng, PublishConfig(bucket_bytes=16 << 10))
        with pytest.raises(PublishError) as ei:
            pub.publish(weights(2), version=1)
        assert isinstance(ei.value.cause, ReceiverDied) and 1 in pub.poisoned
    finally:
        eng.shutdown()
    assert _gone(pid) and group_gone(sched.workers[0].pid)


def test_server_config_validates_and_builds_the_role_env():
    from omegaconf import OmegaConf

    from colocate.config import SGLangServerConfig
    from colocate.sglang_engine import sglang_server_launch_args

    cfg = SGLangServerConfig(model_path="/ckpt", role="teacher", devices=[1], env={"A": "1", "B": ""})
    assert cfg.role_env() == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None,
                              "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1", "HF_HUB_OFFLINE": "1", "A": "1", "B": None}
    assert SGLangServerConfig(model_path="/c", cuda_graph=False).role_env()["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] is None
    args = sglang_server_launch_args(cfg)
    assert (args["role"], args["devices"], args["port"], args["model_path"], args["enable_memory_saver"]) == \
        ("teacher", [1], None, "/ckpt", True)
    assert args["cuda_graph_bs_decode"] == [1, 2, 4] and args["timeout_s"] == 600.0
    back = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SGLangServerConfig),
                                               {"model_path": "/m", "tp_size": 2, "env": {"X": "y"}}))
    assert isinstance(back, SGLangServerConfig) and back.tp_size == 2 and back.env == {"X": "y"}
    for kw, field in (({"model_path": ""}, "model_path"), ({"port": 70000}, "port"), ({"tp_size": 0}, "tp_size"),
                      ({"mem_fraction_static": 1.5}, "mem_fraction_static"), ({"role": "a b"}, "role"),
                      ({"start_timeout_s": 0}, "start_timeout_s"),
                      ({"alloc_conf": "expandable_segments:True"}, "alloc_conf")):
        with pytest.raises(ConfigError, match=f"SGLangServerConfig.{field}"):
            SGLangServerConfig(**{"model_path": "/m", **kw})
    SGLangServerConfig(model_path="/m", alloc_conf="expandable_segments:True", memory_saver=False)  # allowed then
