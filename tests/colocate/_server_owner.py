"""An owner for the launch test: starts an SGLang-contract server through
``SGLangEngine.launch_server`` (``python -m tests.colocate._server_owner CKPT LOG``), prints the
server's and its guard's pids, then dies hard (SIGKILL)."""

import os
import signal
import sys

import torch

from colocate import SGLangEngine

from ._contract_server import SPEC

if __name__ == "__main__":
    eng = SGLangEngine.launch_server(spec=SPEC, param_dtype=torch.float32, ipc="cpu", model_path=sys.argv[1],
                                     log_path=sys.argv[2], server_module="tests.colocate._contract_server",
                                     start_timeout_s=150)
    print(eng.client.get("/probe")["pid"], eng.client.worker.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
