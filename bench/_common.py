"""Shared benchmark plumbing: quantile timing, peak memory, machine header, JSON rows, PNG plots.

Every benchmark writes one JSON file of rows ``{bench, case, provider, metric, value, ...}`` plus a
machine header, prints a short table with ratios against the baseline provider of the same run,
and draws a PNG. Output folder: ``$BENCH_OUT``, else ``$OUT`` (GPU lane), else ``./outputs/bench``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["out_dir", "machine_header", "time_cuda", "time_cpu", "peak_memory", "kernel_profile", "kernel_kind",
           "gpu_idle", "host_profile", "write_results", "print_table", "plot_speedup_vs_c"]


def out_dir() -> Path:
    path = Path(os.environ.get("BENCH_OUT") or os.environ.get("OUT") or "outputs/bench")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _git_commit() -> str:
    """``MCD_COMMIT`` when set (the GPU box's copy of the repository can carry a stale HEAD, so
    the lane scripts pass the commit described on the machine that sent the tree), else
    ``git describe --always --dirty``."""
    if os.environ.get("MCD_COMMIT"):
        return os.environ["MCD_COMMIT"]
    try:
        # "-dirty" when the tree differs from HEAD (e.g. a device copy of an uncommitted tree)
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - git may be absent on the device
        return "unknown"


SOURCE_DIRS = ("mcore_distill", "mopd", "harts", "optim_staged", "colocate", "shared_teacher", "bench", "examples")


def source_digest(root: Path | str | None = None) -> str:
    """12 hex digits of SHA-256 over every ``*.py`` file of the packages, ``bench/`` and
    ``examples/`` (relative path and bytes, in path order). It names the code a result came from
    even where the commit cannot be read (a device copy of the tree with a stale ``.git``): run
    ``python -m bench._common`` on a checkout to compare."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for f in sorted((root / d).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def machine_header() -> dict[str, Any]:
    """Date, host, GPU, and versions of the packages that matter for the numbers."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    # from the installed metadata, not by importing: importing megatron.core would switch
    # torch_memory_saver's hook mode and break an SGLang engine started later in this process
    for label, dist in (("triton", "triton"), ("megatron.core", "megatron-core"), ("fla", "fla-core"),
                        ("emerging_optimizers", "emerging-optimizers"), ("transformers", "transformers"),
                        ("sglang", "sglang")):
        try:
            versions[label] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # optional packages
            pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpu_count": os.cpu_count(),
        "commit": _git_commit(),
        "source_digest": source_digest(),
        "versions": versions,
    }


def _quantiles(samples: list[float]) -> dict[str, float]:
    t = torch.tensor(samples, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    return {"p20": q[0], "p50": q[1], "p80": q[2], "n": len(samples)}


def sync() -> None:
    """Wait for the current CUDA device (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn: Callable[[], Any]) -> float:
    """Wall milliseconds of one call of ``fn``, device synchronized before and after."""
    return wall_and_issue_ms(fn)[0]


def wall_and_issue_ms(fn: Callable[[], Any]) -> tuple[float, float]:
    """``(wall, issue)`` milliseconds of one call of ``fn``: wall with the device synchronized before
    and after, issue until ``fn`` returns (the host's time to launch the work, before the final sync)."""
    sync()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    sync()
    return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3


def time_cuda(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10) -> dict[str, float]:
    """Milliseconds per call from CUDA events (p20/p50/p80)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return _quantiles(samples)


def time_cpu(fn: Callable[[], Any], *, warmup: int = 1, iters: int = 5) -> dict[str, float]:
    """Milliseconds per call from wall clock (p20/p50/p80); synchronizes CUDA if present."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _quantiles(samples)


def time_interleaved(fns: dict[str, Callable[[], Any]], *, rounds: int = 5, warmup: int = 1) -> dict[str, dict]:
    """Wall milliseconds of every function in ``fns``, measured in ``rounds`` interleaved rounds (one
    call of each per round; round ``r`` starts at the ``r``-th function, so none always runs first or
    after the same neighbour): per name the samples, ``min`` and p20/p50/p80, and ``issue_samples``:
    each sample's host time until the function returned (:func:`wall_and_issue_ms`; a step whose wall
    follows it is host-bound). Clock, thermal and host-load drift then hit every function alike;
    compare minima."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    issue: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            wall, host = wall_and_issue_ms(fns[name])
            samples[name].append(wall)
            issue[name].append(host)
    return {n: {**_quantiles(v), "min": min(v), "samples": v, "issue_samples": issue[n]} for n, v in samples.items()}


def peak_memory(fn: Callable[[], Any]) -> int:
    """Peak CUDA bytes allocated above the level before ``fn`` (0 without CUDA)."""
    if not torch.cuda.is_available():
        fn()
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


_KINDS = (("nvjet", "gemm"), ("gemm", "gemm"), ("cublas", "gemm"), ("flash", "flash attention"),
          ("reduce_kernel", "reduce"), ("indexFunc", "index/gather/scatter"), ("gather", "index/gather/scatter"),
          ("scatter", "index/gather/scatter"), ("index", "index/gather/scatter"), ("copy", "copy"),
          ("elementwise", "elementwise"), ("layer_norm", "norm"), ("Norm", "norm"), ("Cat", "cat"))


def kernel_kind(name: str) -> str:
    """Coarse kind of a CUDA kernel from its name (gemm, flash attention, reduce, ... , other)."""
    for key, kind in _KINDS:
        if key in name:
            return kind
    return "other"


def kernel_profile(fn: Callable[[], Any], trace_path: Path | None = None) -> dict[str, Any]:
    """One profiled call of ``fn`` (CUDA): ``kernel_ms`` (sum of kernel durations: the GPU's busy
    time, which a host-bound step exceeds on the wall clock), ``by_kind`` (ms per
    :func:`kernel_kind`), ``wall_ms`` of the profiled call (profiler overhead included) and
    ``idle`` (:func:`gpu_idle`: where the GPU waited for the host) and ``cpu_self``: the 15
    operators with the most host time of their own (``[name, calls, self_ms, total_ms]``, every
    thread, the autograd engine's included; profiler overhead included).
    ``trace_path``: also write the chrome trace there (gzip). Without CUDA: ``{}``."""
    if not torch.cuda.is_available():
        return {}
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        trace = json.loads(Path(tmp.name).read_text())
    if trace_path is not None:
        with gzip.open(trace_path, "wt") as f:
            json.dump(trace, f)
    kinds: dict[str, float] = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel":
            k = kernel_kind(e["name"])
            kinds[k] = kinds.get(k, 0.0) + e["dur"] / 1e3
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:15]
    return {"kernel_ms": sum(kinds.values()), "wall_ms": wall,
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "idle": gpu_idle(trace),
            "cpu_self": [[a.key, a.count, round(a.self_cpu_time_total / 1e3, 3), round(a.cpu_time_total / 1e3, 3)]
                         for a in host]}


def host_profile(fn: Callable[[], Any], *, iters: int = 3, top: int = 12) -> dict[str, Any]:
    """Where the host spends one call of ``fn``: ``issue_ms`` (median over ``iters`` of the time
    until ``fn`` returns, before the device synchronization: the host's own time per step, which
    bounds the step from below when it exceeds the GPU's), ``wall_ms`` (with the synchronization)
    and, from one call under :mod:`cProfile`, the ``top`` functions by own time
    (``[file:line(function), calls, tottime_ms, cumtime_ms]``; cProfile slows Python code, so read
    them as shares, not absolute times)."""
    import cProfile
    import pstats

    issue, wall = [], []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        issue.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    prof = cProfile.Profile()
    sync()
    prof.enable()
    fn()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]

    def name(k):
        f, line, fn_name = k
        return f"{'/'.join(Path(f).parts[-2:]) if f != '~' else ''}:{line}({fn_name})"

    return {"issue_ms": sorted(issue)[len(issue) // 2], "wall_ms": sorted(wall)[len(wall) // 2],
            "profiled_ms": sum(v[2] for v in stats.values()) * 1e3,
            "top_tottime": [[name(k), v[1], round(v[2] * 1e3, 3), round(v[3] * 1e3, 3)] for k, v in rows]}


def write_results(name: str, rows: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> Path:
    """Write ``{header, rows, extra}`` to ``<out>/<name>.json`` and return the path."""
    path = out_dir() / f"{name}.json"
    payload = {"header": machine_header(), "rows": rows, "extra": extra or {}}
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Print rows as a fixed-width table (the short summary printed last on the GPU lane)."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def plot_speedup_vs_c(series: list[tuple[str, str, list[tuple[float, float, str]]]], path: Path, *,
                      ylabel: str, show_09: bool = True) -> None:
    """Scatter of measured speedup against compression C with the line speedup = C (and 0.9·C).
    ``series``: ``(label, marker, [(C, speedup, case name), ...])`` per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    cs = [2.0]
    for label, marker, pts in series:
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=label, marker=marker)
        for c, s, name in pts:
            ax.annotate(name, (c, s), fontsize=7)
        cs += [p[0] for p in pts]
    lim = max(cs) * 1.05
    ax.plot([1, lim], [1, lim], "k--", lw=0.8, label="speedup = C")
    if show_09:
        ax.plot([1, lim], [0.9, 0.9 * lim], "k:", lw=0.8, label="0.9 C")
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("compression C = ΣL / T")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
               "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaStreamWaitEvent")


def gpu_idle(trace: dict[str, Any], *, top: int = 12) -> dict[str, Any]:
    """Where a profiled CUDA call left the GPU idle (from a torch.profiler chrome trace).

    Walks the GPU operations (kernels, memcpy, memset) in time order. Each gap between one op's
    end and the next op's start is either *starved* (the next op was launched by the host after
    the GPU had already gone idle: the host was the bottleneck there) or *queued* (launched
    earlier: the GPU's own launch latency). Starved time is attributed to the CPU operator that
    launched the next op and to the innermost ``record_function`` range around that launch.
    Also returns ``busy_ms`` (union of GPU op intervals), ``gpu_ops`` and the CUDA runtime
    calls that can block the host (synchronizations, allocations) with count and ms.
    """
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in ev if e.get("cat") in _GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        return {}
    launch = {e["args"].get("correlation"): e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in e.get("args", {})}
    cpu_ops = [e for e in ev if e.get("cat") == "cpu_op"]
    by_ext = {e["args"].get("External id"): e for e in cpu_ops if "External id" in e.get("args", {})}
    ranges = sorted((e for e in ev if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])

    def scope(tid, ts):
        best = None
        for r in ranges:
            if r["ts"] > ts:
                break
            if r.get("tid") == tid and r["ts"] + r["dur"] >= ts and (best is None or r["ts"] >= best["ts"]):
                best = r
        return best["name"] if best else "-"

    busy = 0.0
    end = gpu[0]["ts"]
    starved: dict[str, float] = {}
    starved_scope: dict[str, float] = {}
    queued = [0, 0.0]
    starved_n = 0
    for e in gpu:
        gap = e["ts"] - end
        if gap > 0:
            ln = launch.get(e["args"].get("correlation"))
            if ln is not None and ln["ts"] > end:
                starved_n += 1
                op = by_ext.get(ln["args"].get("External id"))
                name = op["name"] if op else ln["name"]
                starved[name] = starved.get(name, 0.0) + gap / 1e3
                sc = scope(ln.get("tid"), ln["ts"])
                starved_scope[sc] = starved_scope.get(sc, 0.0) + gap / 1e3
            else:
                queued[0] += 1
                queued[1] += gap / 1e3
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    calls: dict[str, list[float]] = {}
    for e in ev:
        if e.get("cat") == "cuda_runtime" and any(e["name"].startswith(s.strip()) for s in _SYNC_CALLS):
            c = calls.setdefault(e["name"], [0, 0.0])
            c[0] += 1
            c[1] += e["dur"] / 1e3

    def topk(d):
        return dict(sorted(((k, round(v, 3)) for k, v in d.items()), key=lambda kv: -kv[1])[:top])

    return {"span_ms": (end - gpu[0]["ts"]) / 1e3, "busy_ms": busy / 1e3, "gpu_ops": len(gpu),
            "starved_ms": sum(starved.values()), "starved_gaps": starved_n, "queued_ms": queued[1],
            "queued_gaps": queued[0], "starved_by_op": topk(starved), "starved_by_scope": topk(starved_scope),
            "blocking_calls": {k: {"n": int(v[0]), "ms": round(v[1], 3)} for k, v in calls.items()}}


if __name__ == "__main__":  # the source digest of this checkout (compare with a result's header)
    print(source_digest())
