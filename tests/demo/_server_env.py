"""Run under torchrun (one rank): start the demo's teacher server (``teacher_server.kind=hf``) on a
tiny checkpoint through :func:`examples.demo.teacher_server.start_teacher_server`, print the rank's
and the server process's values of the launcher variables as one JSON line, stop the server."""

import json
import os
import sys
from pathlib import Path

from tests._procs import child_running

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_RUN_ID", "HF_HUB_OFFLINE", "COLOCATE_ROLE")


def _server_pid(guard: int) -> int:
    """The guard's child that runs ``mopd.hf_server`` (not the guard's watcher fork)."""
    pid = child_running(guard, "mopd.hf_server")
    if pid is None:
        raise SystemExit("no server process under the guard")
    return pid


if __name__ == "__main__":
    import torch

    from colocate.sglang_engine import write_hf_checkpoint
    from examples.demo.config import DemoConfig
    from examples.demo.teacher_server import start_teacher_server
    from tests.colocate._contract_server import SPEC, weights

    out = sys.argv[1]
    write_hf_checkpoint(f"{out}/hf", weights(1), spec=SPEC, dtype=torch.float32)
    server = start_teacher_server(DemoConfig(out_dir=out), f"{out}/hf", log_path=f"{out}/teacher_server.log")
    try:
        raw = Path(f"/proc/{_server_pid(server.worker.pid)}/environ").read_bytes().split(b"\0")
        env = dict(x.decode().split("=", 1) for x in raw if b"=" in x)
        print(json.dumps({"rank": {k: os.environ.get(k) for k in KEYS}, "server": {k: env.get(k) for k in KEYS}}),
              flush=True)
    finally:
        server.stop()
