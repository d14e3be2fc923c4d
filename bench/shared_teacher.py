"""Shared teacher source: teacher-forward cost per student, end-to-end throughput, pool memory, store speed.

Providers (same run, same teacher, same data):
  separate — each of N students runs its own teacher pass over the data (N × D teacher forwards);
  shared   — one producer feeds N students through one SharedTeacherSource (D forwards), over the
             real control plane (Unix-socket RPC) and a shared-memory store; students read every
             feature object and ack per step.
Store micro-benchmark: put / get bandwidth of ShmStore and FileStore for EAGLE-3-like objects.

Run: ``python -m bench.shared_teacher`` (GPU, well under a minute on one H200 expected; not yet run) or
``--quick`` (CPU smoke, ~30 s). The GPU teacher has the Qwen3-0.6B shape with random weights.
Writes ``shared_teacher.json`` and ``shared_teacher.png`` into ``$OUT`` (or ./outputs/bench).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from bench._common import out_dir, print_table, sync, write_results


def _init(device: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from mcore_distill.testing import free_port, init_megatron

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device == "cpu":
        from mcore_distill import cpu_compat

        cpu_compat.enable()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    init_megatron(seed=0)


def _teacher(args, device: str):
    """Random-init Megatron GPT teacher; on CUDA initialized on the device (fast), CPU init as fallback."""
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt

    def cfg(**extra):
        return TinyGPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                             num_attention_heads=args.heads, num_query_groups=args.groups,
                             ffn_hidden_size=args.ffn, max_sequence_length=args.seq,
                             params_dtype=torch.bfloat16 if device == "cuda" else torch.float32, extra=extra)

    if device != "cuda":
        return build_tiny_gpt(cfg()).eval()
    from megatron.core.transformer.module import Float16Module

    try:
        model = build_tiny_gpt(cfg(use_cpu_initialization=False))
    except Exception as exc:  # noqa: BLE001 - fall back to the CPU initialization the tests use
        print(f"on-device init failed ({type(exc).__name__}: {exc}); initializing on CPU", flush=True)
        model = build_tiny_gpt(cfg())
    model = Float16Module(model.config, model.cuda())
    return model.eval()


def _key(args):
    from shared_teacher import CompatKey

    return CompatKey(teacher_fingerprint="bench", tokenizer="ids", signals=["logprobs", "topk", "hidden"],
                     top_k=args.top_k, hidden_taps=[0, args.layers // 2, args.layers - 1], dtype="bfloat16",
                     max_length=args.seq, dataset="bench", seed=0)


def _data(args) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.samples,), generator=g).tolist()
    return [torch.randint(0, args.vocab, (n,), generator=g) for n in lengths]


def _make_store(need_bytes: int):
    """ShmStore if /dev/shm has room for ``2 × need_bytes`` (containers often mount 64 MiB), else a FileStore
    in a temporary folder (not under $OUT). Returns (store, kind)."""
    import shutil
    import tempfile

    from shared_teacher import FileStore, ShmStore

    try:
        if shutil.disk_usage("/dev/shm").free >= 2 * need_bytes:
            return ShmStore(), "shm"
    except OSError:
        pass
    return FileStore(tempfile.mkdtemp(prefix="stbench-")), "file"


def run_separate(teacher_fn, data, n_students: int, batch: int) -> dict:
    """Each student scores the data itself (what you pay without sharing)."""
    t0 = time.perf_counter()
    teacher_s = 0.0
    for _ in range(n_students):
        for i in range(0, len(data), batch):
            t1 = time.perf_counter()
            teacher_fn(data[i:i + batch])
            sync()
            teacher_s += time.perf_counter() - t1
    return {"wall_s": time.perf_counter() - t0, "teacher_s": teacher_s, "forward_samples": n_students * len(data),
            "peak_pool_bytes": 0}


def run_shared(teacher_fn, data, n_students: int, batch: int, key, *, high: int, hidden: int) -> dict:
    """One producer → one source → N student readers (threads; real RPC, real shared-memory store)."""
    from shared_teacher import (
        NodeLimits,
        SharedTeacherSource,
        SourceConfig,
        SourceServer,
        StudentReader,
        StudentSpec,
        run_producer,
    )
    from shared_teacher.features import max_object_bytes

    students = [StudentSpec(name=f"s{i}", ranks_per_node={"n0": 1}, micro_batch_size=batch) for i in range(n_students)]
    cfg = SourceConfig(key=key, nodes={"n0": NodeLimits(high_samples=high, low_samples=high - 1)}, students=students,
                       dataset_size=len(data), max_sample_bytes=max_object_bytes(key, hidden_size=hidden),
                       max_seq_len=key.max_length,
                       lease_timeout_s=60, watchdog_s=120)
    store, store_kind = _make_store(high * cfg.max_sample_bytes)
    src = SharedTeacherSource(cfg, store)
    server = SourceServer(src)
    peak = {"bytes": 0, "samples": 0}
    read_bytes = [0] * n_students
    timed = {"teacher_s": 0.0}

    def timed_teacher(seqs):
        t1 = time.perf_counter()
        out = teacher_fn(seqs)
        sync()
        timed["teacher_s"] += time.perf_counter() - t1
        return out

    def student(i: int) -> None:
        reader = StudentReader(server.connect_info, student=f"s{i}", rank=0, key=key, store_spec=store.spec())
        for w in reader:
            for m, mb in enumerate(w.micro_batches):
                for f in reader.load(mb):
                    read_bytes[i] += sum(t.numel() * t.element_size() for t in f.values())
                reader.ack_read(w, m)
            reader.ack_step(w)
        reader.close()

    def watch(stop: threading.Event) -> None:
        while not stop.wait(0.01):
            g = src.stats()["nodes"]["n0"]
            peak["bytes"] = max(peak["bytes"], g["in_flight_bytes"])
            peak["samples"] = max(peak["samples"], g["in_flight_samples"])

    threads = [threading.Thread(target=student, args=(i,)) for i in range(n_students)]
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    watcher.start()
    stats = run_producer(server.connect_info, store_spec=store.spec(), teacher=timed_teacher, dataset=data, key=key,
                         batch_size=batch)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    leaked = len(store.objects())
    server.close()
    src.close()
    store.close(remove=True)
    return {"wall_s": wall, "teacher_s": timed["teacher_s"], "forward_samples": stats["forward_samples"],
            "peak_pool_bytes": peak["bytes"], "peak_pool_samples": peak["samples"], "leaked_objects": leaked,
            "put_bytes": stats["put_bytes"], "read_bytes": sum(read_bytes), "store": store_kind}


def store_bandwidth(sizes_mib: list[int], reps: int) -> list[dict]:
    """put/get GB/s of one object per size (bf16 payload), shared memory vs local files."""
    import shutil
    import tempfile

    from shared_teacher import FileStore, ShmStore

    rows = []
    for kind in ("shm", "file"):
        if kind == "shm" and shutil.disk_usage("/dev/shm").free < 3 * (max(sizes_mib) << 20):
            print(f"store bench: /dev/shm has < {3 * max(sizes_mib)} MiB free; skipping shm")
            continue
        store = ShmStore() if kind == "shm" else FileStore(tempfile.mkdtemp(prefix="stbench-"))
        for mib in sizes_mib:
            x = {"hidden": torch.randn(mib * (1 << 19)).to(torch.bfloat16)}
            put_s, get_s = [], []
            for r in range(reps):
                t0 = time.perf_counter()
                ref = store.put(x, sample_id=f"e0-i{r}", generation=1, node="n0", num_tokens=1, schema_key="b",
                                epoch=0, position=r)
                put_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                store.get(ref)
                get_s.append(time.perf_counter() - t0)
                store.release(ref)
            gb = mib / 1024
            rows.append({"bench": "shared_teacher", "case": f"store-{mib}MiB", "provider": kind,
                         "metric": "put_GBps", "value": gb / sorted(put_s)[len(put_s) // 2]})
            rows.append({"bench": "shared_teacher", "case": f"store-{mib}MiB", "provider": kind,
                         "metric": "get_GBps", "value": gb / sorted(get_s)[len(get_s) // 2]})
        store.close(remove=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    p.add_argument("--students", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        args.hidden, args.layers, args.heads, args.groups, args.ffn, args.vocab = 64, 2, 4, 1, 256, 256
        args.seq, args.samples, args.batch, args.top_k, sizes, reps = 32, 24, 4, 8, [1, 4], 3
    else:
        # Qwen3-0.6B shape (random weights): 28 layers, hidden 1024, 16 heads / 8 KV groups, SwiGLU 3072,
        # 151,936-token vocabulary, bf16; 512-token sequences
        args.hidden, args.layers, args.heads, args.groups, args.ffn, args.vocab = 1024, 28, 16, 8, 3072, 151936
        args.seq, args.samples, args.batch, args.top_k, sizes, reps = 512, 32, 8, 64, [16, 64], 3
    t_start = time.perf_counter()
    _init(device)
    teacher = _teacher(args, device)
    print(f"teacher: {sum(p.numel() for p in teacher.parameters()) / 1e6:.1f} M params on {device}, "
          f"built in {time.perf_counter() - t_start:.1f} s", flush=True)
    from shared_teacher import MegatronTeacher

    key = _key(args)
    fn = MegatronTeacher(teacher, key=key)
    data = _data(args)
    run_separate(fn, data, 1, args.batch)  # warm-up: allocator, kernels, every sequence length once
    rows, table = [], []
    for n in args.students:
        sep = run_separate(fn, data, n, args.batch)
        sh = run_shared(fn, data, n, args.batch, key, high=4 * args.batch, hidden=args.hidden)
        if sh["leaked_objects"]:
            raise RuntimeError(f"shared run leaked {sh['leaked_objects']} objects")
        for name, r in (("separate", sep), ("shared", sh)):
            per_student_ms = 1e3 * r["teacher_s"] / n
            samples_s = n * len(data) / r["wall_s"]
            for metric, value in (("teacher_ms_per_student", per_student_ms), ("student_samples_per_s", samples_s),
                                  ("wall_s", r["wall_s"]), ("forward_samples", r["forward_samples"]),
                                  ("peak_pool_MiB", r["peak_pool_bytes"] / 2**20)):
                rows.append({"bench": "shared_teacher", "case": f"N={n}", "provider": name, "metric": metric,
                             "value": value})
        table.append({"students": n, "teacher_ms/student sep": 1e3 * sep["teacher_s"] / n,
                      "teacher_ms/student shared": 1e3 * sh["teacher_s"] / n,
                      "ratio": sh["teacher_s"] / max(sep["teacher_s"], 1e-9),
                      "samples/s sep": n * len(data) / sep["wall_s"], "samples/s shared": n * len(data) / sh["wall_s"],
                      "speedup e2e": sep["wall_s"] / sh["wall_s"], "forwards shared": sh["forward_samples"],
                      "peak pool MiB": sh["peak_pool_bytes"] / 2**20, "store": sh["store"]})
        # partial results survive a wall-clock limit
        write_results("shared_teacher", rows, {"args": vars(args), "device": device, "partial": True})
        print(f"N={n}: {table[-1]} ({time.perf_counter() - t_start:.1f} s so far)", flush=True)
    store_rows = store_bandwidth(sizes, reps)
    rows += store_rows
    extra = {"args": vars(args), "device": device, "bench_wall_s": time.perf_counter() - t_start,
             "teacher_params": sum(p.numel() for p in teacher.parameters())}
    path = write_results("shared_teacher", rows, extra)
    _plot(table, store_rows)
    print(f"wrote {path}")
    print_table([{"case": r["case"], "store": r["provider"], "metric": r["metric"], "GB/s": r["value"]}
                 for r in store_rows], ["case", "store", "metric", "GB/s"])
    print_table(table, list(table[0]))


def _plot(table: list[dict], store_rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ns = [r["students"] for r in table]
    xs = range(len(ns))
    a.bar([x - 0.2 for x in xs], [r["teacher_ms/student sep"] for r in table], 0.4, label="separate teachers")
    a.bar([x + 0.2 for x in xs], [r["teacher_ms/student shared"] for r in table], 0.4, label="shared source")
    a.set_xticks(list(xs), [f"N={n}" for n in ns])
    a.set_ylabel("teacher forward ms per student")
    a.legend()
    cases = sorted({r["case"] for r in store_rows})
    provs = [p for p in ("shm", "file") if any(r["provider"] == p for r in store_rows)]
    for i, (prov, metric) in enumerate([(p, m) for p in provs for m in ("put_GBps", "get_GBps")]):
        vals = [next(r["value"] for r in store_rows if r["case"] == c and r["provider"] == prov and r["metric"] == metric)
                for c in cases]
        b.bar([j + 0.2 * i - 0.3 for j in range(len(cases))], vals, 0.2, label=f"{prov} {metric[:3]}")
    b.set_xticks(range(len(cases)), cases)
    b.set_ylabel("GB/s")
    b.legend()
    fig.tight_layout()
    fig.savefig(out_dir() / "shared_teacher.png", dpi=120)


if __name__ == "__main__":
    main()
