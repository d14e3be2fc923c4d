"""HF checkpoint → Megatron load time and peak host memory (``mcore_distill.hf``).

A Qwen3-0.6B-shaped model (28 layers, H 1024, 16/8 heads, head dim 128, F 3072, vocab 151,936,
tied embeddings; random bf16 weights) is built in Megatron and written by ``save_hf_checkpoint``
(sharded, ``--shard-mib`` per file). Then, each in a fresh process (so each peak is its own),
interleaved over ``--runs`` rounds:

* ``megatron_tp1`` — ``megatron_model_from_hf`` on one device (build + load), then a second
  ``load_hf_checkpoint`` into the built model (load alone);
* ``megatron_tp2`` — the same under ``torchrun --nproc-per-node 2`` at TP = 2 (when two GPUs are
  visible, or with ``--quick`` on CPU): each rank reads only its slices; the slower rank counts;
* ``transformers`` — ``AutoModelForCausalLM.from_pretrained`` of the same folder, then moved to
  the same device (``device_map`` needs ``accelerate``, which is not installed): the loader a
  user has without Megatron (peer);
* ``safetensors`` — ``safetensors.torch.load_file`` of every shard to host memory and dropped:
  the read floor (every byte once, no conversion).

Peak host memory is the process's RSS high-water mark (``VmHWM``, reset before the measured call
through ``/proc/self/clear_refs`` where allowed) minus its RSS just before the call; the page cache
is warm (the checkpoint was just written). The loader's bound is one shard file plus one tensor
(``bound_MiB`` in the results). Reported: the minimum over the runs.

Run (repository root on ``PYTHONPATH``, as ``scripts/gpu-lane.sh`` sets it): ``python -m bench.hf_load``
(GPU; ``bash scripts/gpu-lane.sh bench hf_load``), ``python -m bench.hf_load --quick`` (CPU smoke, tiny shape).
Writes ``hf_load.json`` and ``hf_load.png`` into ``$BENCH_OUT`` (or ``$OUT``, ``outputs/bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": True, "attention_bias": False,
    "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None, "torch_dtype": "bfloat16",
}
TINY = {**QWEN3_0_6B, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


# ----- measurement helpers (in the worker processes) ------------------------------------------------
def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    """Reset the RSS high-water mark (Linux ``clear_refs`` 5); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status("VmHWM") <= _status("VmRSS") + (1 << 20)


class _Peak:
    """Seconds and peak RSS growth of the enclosed block."""

    def __enter__(self):
        self.reset = _reset_hwm()
        self.rss0 = _status("VmRSS")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        self.peak = max(0, _status("VmHWM") - self.rss0)


def _init(cpu: bool) -> str:
    """Process group (torchrun's env, or a one-rank group) and Megatron parallel state (TP = world)."""
    from megatron.core import parallel_state as ps

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cpu:
        from mcore_distill import cpu_compat

        cpu_compat.enable()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world == 1:
        from mcore_distill.testing import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    torch.distributed.init_process_group("gloo" if cpu else "nccl")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    from mcore_distill.testing import seed_all

    seed_all(0)  # Megatron's RNG tracker: random init on CUDA (the save worker) draws from it
    return "cpu" if cpu else "cuda"


def worker(args) -> dict:
    """One measurement (``--worker NAME``); the result goes to ``--result`` as JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    ckpt, out = args.ckpt, {"provider": args.worker, "rank": int(os.environ.get("RANK", "0"))}
    if args.worker == "save":
        from mcore_distill.hf import megatron_model_from_hf, save_hf_checkpoint

        _init(args.cpu)
        cfg_dir = Path(ckpt).with_name("config-only")
        cfg_dir.mkdir(exist_ok=True)
        cfg = TINY if args.quick else QWEN3_0_6B
        (cfg_dir / "config.json").write_text(json.dumps(cfg))
        chunks = megatron_model_from_hf(cfg_dir, load=False, params_dtype=torch.bfloat16)
        with _Peak() as p:
            rep = save_hf_checkpoint(chunks, ckpt, hf_config=cfg, max_shard_bytes=int(args.shard_mib * 2**20))
        out.update(save_s=p.seconds, save_peak=p.peak, files=rep.files, bytes=rep.bytes, tensors=rep.tensors)
    elif args.worker.startswith("megatron"):
        from mcore_distill.hf import load_hf_checkpoint, megatron_model_from_hf

        _init(args.cpu)
        with _Peak() as p:
            chunks = megatron_model_from_hf(ckpt, params_dtype=torch.bfloat16)
        with _Peak() as q:
            rep = load_hf_checkpoint(chunks, ckpt)
        out.update(build_load_s=p.seconds, build_load_peak=p.peak, load_s=q.seconds, load_peak=q.peak,
                   bytes_read=rep.bytes_read, hwm_reset=q.reset)
    elif args.worker == "transformers":
        import transformers

        device = "cpu" if args.cpu else "cuda"
        if not args.cpu:
            torch.cuda.init()
        cls = getattr(transformers, transformers.AutoConfig.from_pretrained(ckpt).architectures[0])  # imports, untimed
        with _Peak() as p:  # device_map needs accelerate (not installed): host load, then moved
            cls.from_pretrained(ckpt, dtype=torch.bfloat16).to(device)
        out.update(load_s=p.seconds, load_peak=p.peak, hwm_reset=p.reset)
    elif args.worker == "safetensors":
        from safetensors.torch import load_file

        with _Peak() as p:
            n = 0
            for f in sorted(Path(ckpt).glob("*.safetensors")):
                n += sum(t.numel() * t.element_size() for t in load_file(f).values())
        out.update(load_s=p.seconds, load_peak=p.peak, bytes_read=n, hwm_reset=p.reset)
    Path(args.result).with_suffix(f".{out['rank']}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return out


# ----- driver ----------------------------------------------------------------------------------------
def _spawn(name: str, args, ckpt: str, tmp: Path, nproc: int = 1) -> list[dict]:
    result = tmp / f"{name}-{time.monotonic_ns()}"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--ckpt", ckpt, "--result", str(result),
           "--shard-mib", str(args.shard_mib)] + ["--cpu"] * args.cpu + ["--quick"] * args.quick
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + cmd[1:]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    if nproc == 1:  # a rendezvous of its own: a MASTER_PORT inherited from the caller may be taken
        from mcore_distill.testing import free_port

        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(tmp.glob(result.name + ".*.json"))]


def _bound(ckpt: str) -> int:
    """One shard file plus the largest tensor, bytes."""
    from mcore_distill.hf.safetensors_io import open_checkpoint

    idx = open_checkpoint(ckpt)
    biggest = max(os.path.getsize(Path(ckpt) / f) for f in idx.files)
    size = {"BF16": 2, "F16": 2, "F32": 4}
    tensor = max(torch.Size(t.shape).numel() * size.get(t.dtype, 4) for t in idx.tensors.values())
    return biggest + tensor


def _plot(summary: list[dict], bound_mib: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["provider"] for r in summary]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [r["load_s"] for r in summary], color="tab:blue")
    a.set_ylabel("load seconds (min over runs)")
    a.set_title("load time")
    b.bar(names, [r["peak_MiB"] for r in summary], color="tab:orange")
    b.axhline(bound_mib, color="k", ls="--", lw=0.8, label="one shard file + one tensor")
    b.set_ylabel("peak host RSS growth, MiB")
    b.set_title("peak host memory")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape on CPU (smoke test)")
    ap.add_argument("--runs", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    ap.add_argument("--shard-mib", type=float, default=None, help="max MiB per safetensors file (default 512)")
    ap.add_argument("--tp2", choices=("auto", "on", "off"), default="auto",
                    help="TP=2 run: auto = when 2 GPUs are visible (or --quick on CPU)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.shard_mib is None:
        args.shard_mib = 0.1 if args.quick else 512
    if args.worker:
        worker(args)
        return
    from bench._common import machine_header, out_dir, print_table, write_results

    args.cpu = args.quick or not torch.cuda.is_available()
    runs = args.runs or (2 if args.quick else 5)
    gpus = 0 if args.cpu else torch.cuda.device_count()
    tp2 = args.tp2 == "on" or (args.tp2 == "auto" and (gpus >= 2 or args.quick))
    with tempfile.TemporaryDirectory(prefix="hf_load-") as tmpdir:
        tmp = Path(tmpdir)
        ckpt = str(tmp / "ckpt")
        (saved,) = _spawn("save", args, ckpt, tmp)
        bound = _bound(ckpt)
        providers = ["megatron_tp1"] + ["megatron_tp2"] * tp2 + ["transformers", "safetensors"]
        rows = []
        for run in range(runs):
            for name in providers:
                for r in _spawn(name, args, ckpt, tmp, nproc=2 if name == "megatron_tp2" else 1):
                    rows.append({"bench": "hf_load", "case": "tiny" if args.quick else "qwen3-0.6b-bf16",
                                 "run": run, **r})
    summary = []
    for name in providers:
        mine = [r for r in rows if r["provider"] == name]
        per_run = {}
        for r in mine:  # TP=2: the slower rank / larger peak of each run counts
            cur = per_run.setdefault(r["run"], {"load_s": 0.0, "peak": 0, "bytes_read": 0, "build_load_s": 0.0})
            cur["load_s"] = max(cur["load_s"], r["load_s"])
            cur["peak"] = max(cur["peak"], r["load_peak"])
            cur["bytes_read"] = max(cur["bytes_read"], r.get("bytes_read", 0))
            cur["build_load_s"] = max(cur["build_load_s"], r.get("build_load_s", 0.0))
        summary.append({"provider": name, "load_s": min(v["load_s"] for v in per_run.values()),
                        "build_load_s": min(v["build_load_s"] for v in per_run.values()) or None,
                        "peak_MiB": min(v["peak"] for v in per_run.values()) / 2**20,
                        "max_peak_MiB": max(v["peak"] for v in per_run.values()) / 2**20,
                        "GB_per_s": saved["bytes"] / min(v["load_s"] for v in per_run.values()) / 1e9,
                        "bytes_read_per_rank_MiB": max(v["bytes_read"] for v in per_run.values()) / 2**20,
                        "runs": len(per_run)})
    extra = {"checkpoint_MiB": saved["bytes"] / 2**20, "files": saved["files"], "tensors": saved["tensors"],
             "save_s": saved["save_s"], "save_peak_MiB": saved["save_peak"] / 2**20, "bound_MiB": bound / 2**20,
             "shard_mib": args.shard_mib, "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
             "hwm_reset": all(r.get("hwm_reset", True) for r in rows), "summary": summary}
    path = write_results("hf_load", rows, extra)
    h = machine_header()
    _plot(summary, bound / 2**20, out_dir() / "hf_load.png",
          f"{extra['device']} · {saved['files']} files, {extra['checkpoint_MiB']:.1f} MiB · {h['date']} · {h['commit']}")
    print(f"checkpoint: {extra['checkpoint_MiB']:.1f} MiB in {saved['files']} files, saved in {saved['save_s']:.2f} s "
          f"(peak host +{extra['save_peak_MiB']:.0f} MiB); bound (one file + one tensor) {extra['bound_MiB']:.1f} MiB; "
          f"results: {path}")
    print_table(summary, ["provider", "load_s", "build_load_s", "GB_per_s", "peak_MiB", "max_peak_MiB",
                          "bytes_read_per_rank_MiB", "runs"])


if __name__ == "__main__":
    main()
