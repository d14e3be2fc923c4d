"""A Ray owner for the no-orphans test: joins the cluster at argv[1], forks a role actor, prints
the command's pid and its child's pid, then dies hard (SIGKILL)."""

import os
import signal
import sys

import ray

from colocate.config import WorkerSpec
from colocate.workers import RayScheduler

if __name__ == "__main__":
    ray.init(address=sys.argv[1], namespace="colocate-test", log_to_driver=False)
    sched = RayScheduler()
    w = sched.fork(WorkerSpec(role="rollout", command=[sys.executable, "-m", "tests.colocate._worker"],
                              health_timeout_s=60))
    print(w.info["pid"], w.info["child"], w.probe()["pid"], os.getpgid(w.info["pid"]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
