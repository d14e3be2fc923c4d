"""A colocated worker for the tests: starts a grandchild, reports its env, then waits."""

import os
import subprocess
import time

from colocate.workers import mark_ready

if __name__ == "__main__":
    child = subprocess.Popen(["sleep", "300"])
    mark_ready(child=child.pid, alloc=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), foo=os.environ.get("FOO"),
               bar=os.environ.get("BAR"), role=os.environ.get("COLOCATE_ROLE"))
    time.sleep(300)
