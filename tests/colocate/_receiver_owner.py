"""An owner for the receiver-death test: spawns a receiver, starts a publish that keeps it busy in
a long load, prints the receiver's pid, then dies hard (SIGKILL)."""

import os
import signal
import threading
import time

from colocate import HFModelSpec, PublishConfig, Publisher, spawn_receiver
from colocate.engines import build_hf_model, hf_checkpoint_views

from ._ranks import busy_engine

SPEC = HFModelSpec(arch="qwen3", num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                   head_dim=8, ffn_hidden_size=24, vocab_size=32)

if __name__ == "__main__":
    recv = spawn_receiver(busy_engine, SPEC, 120.0, timeout_s=600)
    w = {n: v.detach().clone() for n, v in hf_checkpoint_views(build_hf_model(SPEC)).items()}
    pub = Publisher(recv, PublishConfig(transport="shm", timeout_s=600))
    threading.Thread(target=pub.publish, args=(w,), kwargs={"version": 1}, daemon=True).start()
    time.sleep(3.0)  # the receiver is inside its first (120 s) load now
    print(recv.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
