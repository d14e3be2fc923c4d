"""GPU lane, real SGLang 0.5.17 HTTP server (two-call carry + ``.whl-sx``): the engine-side
failure paths of ``SGLangEngine.launch_server``, each also covered on CPU against the contract
server (``test_sglang_launch.py``):

* start failure: a model path without a checkpoint → ``EngineStartError`` before the start
  deadline, and no process of the server's group is left;
* crash mid-generate: the server's main process is SIGKILLed while a long generation runs →
  ``generate`` raises ``ReceiverDied`` at once (well before the request deadline); the owner's
  shutdown then leaves no process of the group (SGLang's scheduler and detokenizer included).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from colocate import HFModelSpec, SGLangEngine
from colocate.config import SGLangServerConfig
from colocate.engines import build_hf_model, hf_checkpoint_views
from colocate.errors import EngineStartError, ReceiverDied
from colocate.sglang_engine import write_hf_checkpoint
from colocate.workers import LocalScheduler
from tests._procs import child_running, group_gone, group_pids

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

SPEC = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                   head_dim=64, ffn_hidden_size=512, vocab_size=1024, rope_theta=10000.0)


def _log(name: str, tmp_path) -> str:
    d = os.environ.get("MCD_TEST_ARTIFACTS") or str(tmp_path)
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, name)


@pytest.mark.timeout(200)
def test_real_server_start_failure_is_typed_and_leaves_no_process(tmp_path):
    sched = LocalScheduler()
    cfg = SGLangServerConfig(model_path=str(tmp_path / "missing"), cuda_graph=False, start_timeout_s=150,
                             log_path=_log("sglang_fault_start.log", tmp_path))
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match="exited during start"):
        SGLangEngine.launch_server(cfg, spec=SPEC, scheduler=sched)
    took = time.monotonic() - t0
    (worker,) = sched.workers
    print(f"start failure raised after {took:.1f}s")
    assert took < 150 and not worker.alive() and group_gone(worker.pid, timeout=30)


@pytest.mark.timeout(300)
def test_real_server_crash_mid_generate_is_typed_in_time(tmp_path):
    torch.manual_seed(0)
    w = {n: v.detach().to(torch.bfloat16).clone() for n, v in hf_checkpoint_views(build_hf_model(SPEC)).items()}
    write_hf_checkpoint(tmp_path / "ckpt", w, spec=SPEC)
    sched = LocalScheduler()
    cfg = SGLangServerConfig(model_path=str(tmp_path / "ckpt"), cuda_graph=False, memory_saver=False,
                             start_timeout_s=240, request_timeout_s=120, log_path=_log("sglang_fault_crash.log", tmp_path))
    eng = SGLangEngine.launch_server(cfg, spec=SPEC, scheduler=sched)
    group = eng.client.worker.pid
    try:
        assert len(eng.generate([[1, 2, 3]], max_new_tokens=4)[0]["output_ids"]) == 4
        # the server's main process: the guard's child that runs `python -m sglang.launch_server`
        # (its scheduler and detokenizer are the main process's children; the guard's other child is
        # its watcher fork). 2026-12-01's run took the lowest pid of the group and injected no crash;
        # 2026-12-02's took "the guard's only child" and found two (server and watcher).
        target = child_running(group, "sglang.launch_server")
        assert target is not None, f"no sglang.launch_server child of the guard in group {group_pids(group)}"
        killed = threading.Event()
        threading.Timer(1.0, lambda: (os.kill(target, signal.SIGKILL), killed.set())).start()
        t0 = time.monotonic()
        with pytest.raises(ReceiverDied):
            eng.generate([[1, 2, 3]] * 64, max_new_tokens=4000)  # 64 × 4000 tokens: far longer than 1 s
        took = time.monotonic() - t0
        print(f"crash mid-generate: ReceiverDied after {took:.1f}s (killed pid {target} at 1 s)")
        assert killed.is_set() and took < 60
    finally:
        eng.shutdown()
    assert group_gone(group, timeout=30), "a process of the crashed SGLang server outlived the owner's shutdown"
