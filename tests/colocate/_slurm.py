"""A real single-node Slurm cluster (munge + slurmctld + slurmd) in a temp folder, for tests.

Needs the Debian packages ``slurmctld slurmd slurm-client munge`` (root: munged runs with
``--force``). Daemons are started and stopped by PID; nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "salloc", "scancel", "squeue", "sinfo")


def available() -> bool:
    return all(shutil.which(b) for b in BINARIES)


def _node_memory() -> int:
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    for tok in out.split():
        if tok.startswith("RealMemory="):
            return max(int(tok.split("=")[1]) - 512, 256)
    return 1024


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"slurm test cluster: {what} not within {timeout:.0f}s")
        time.sleep(0.1)


@contextlib.contextmanager
def slurm_cluster(root: Path):
    """Yield the environment (with ``SLURM_CONF``) of a running one-node cluster under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    munge = root / "munge"
    munge.mkdir(mode=0o711)
    key, sock = munge / "munge.key", munge / "munge.socket"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--force"], check=True, capture_output=True, timeout=30)
    os.chmod(key, 0o600)
    cpus = os.cpu_count() or 1
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=colocate-test", "SlurmctldHost=localhost", f"AuthInfo=socket={sock}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MailProg=/bin/true",
        "SchedulerParameters=sched_min_interval=0,batch_sched_delay=0", "SlurmUser=root", "SlurmdUser=root",
        "ReturnToService=2", "MpiDefault=none",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={_node_memory()} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""]))
    for d in ("state", "spool"):
        (root / d).mkdir()
    env = dict(os.environ, SLURM_CONF=str(conf))
    pids: list[int] = []
    try:
        p = subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}",
                            f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                            f"--seed-file={munge}/seed"], capture_output=True, text=True, timeout=30)
        if p.returncode:
            raise RuntimeError(f"munged failed: {p.stderr}")
        _wait(lambda: (munge / "munged.pid").exists(), 10, "munged pid file")
        pids.append(int((munge / "munged.pid").read_text()))
        subprocess.run(["slurmctld", "-f", str(conf), "-i"], env=env, check=True, timeout=30)
        _wait(lambda: (root / "slurmctld.pid").exists(), 15, "slurmctld pid file")
        pids.append(int((root / "slurmctld.pid").read_text()))
        subprocess.run(["slurmd", "-f", str(conf), "-N", "localhost"], env=env, check=True, timeout=30)
        _wait(lambda: (root / "slurmd.pid").exists(), 15, "slurmd pid file")
        pids.append(int((root / "slurmd.pid").read_text()))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=10)
            return out.stdout.strip() in ("idle", "mix")
        _wait(idle, 30, "node idle")
        yield env
    finally:
        for pid in reversed(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in pids:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
