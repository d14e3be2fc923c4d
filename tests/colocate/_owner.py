"""An owner process for the no-orphans test: forks a worker, prints its pid, then dies hard."""

import os
import signal
import sys

from colocate.config import WorkerSpec
from colocate.workers import LocalScheduler

if __name__ == "__main__":
    sched = LocalScheduler()
    w = sched.fork(WorkerSpec(role="rollout", command=[sys.executable, "-m", "tests.colocate._worker"],
                              health_timeout_s=60))
    print(w.pid, w.info["child"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
