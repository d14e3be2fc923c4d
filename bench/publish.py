"""Weight publication: colocated CUDA IPC publish vs a device copy; SGLang publish vs naive loops.

Cases:
* ``ipc``: an 8B-class bf16 parameter set (Qwen3-8B shapes, 16.4 GB) published by
  :class:`colocate.publish.Publisher` (1 GiB buckets, ≤ 2 in flight) from this (trainer) process
  to a receiver process on the same GPU that copies every tensor into its own parameters.
  Baselines in the same run: one device-to-device copy of the same bytes inside one process
  (``d2d_flat``, the copy floor) and a per-tensor ``copy_`` loop (``d2d_per_tensor``). Also
  reported: IPC handles opened, peak extra memory on the trainer side, per-phase times.
* ``--sglang``: a ≥ 1 GB Qwen3 published into a real ``sglang.Engine`` by our publisher
  (512 MiB buckets) vs a naive per-tensor ``update_weights_from_tensor`` loop and a single call
  with every tensor (one IPC handle per tensor); SGLang's checksum must agree across methods.
  Needs SGLang: ``bash .sgl/scripts/go.sh bench/publish.py --sglang``.

Run: ``python bench/publish.py`` (H200, ~1 min), ``python bench/publish.py --quick`` (CPU smoke:
shared-memory transport, small set). Writes ``publish.json`` / ``publish.png`` (or
``publish_sglang.*``) into ``$OUT`` (or ``outputs/bench``); prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import out_dir, print_table, time_cpu, time_cuda, write_results  # noqa: E402
from colocate import HFModelSpec, PublishConfig  # noqa: E402
from colocate.buckets import unpack_bucket  # noqa: E402
from colocate.convert import hf_param_specs  # noqa: E402
from colocate.publish import Publisher  # noqa: E402
from colocate.transports import spawn_receiver  # noqa: E402

GiB = 1 << 30
QWEN3_8B = HFModelSpec(arch="qwen3", num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                       head_dim=128, ffn_hidden_size=12288, vocab_size=151936)
SMALL = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                    head_dim=64, ffn_hidden_size=512, vocab_size=4096)
SGL_1GB = HFModelSpec(arch="qwen3", num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                      head_dim=128, ffn_hidden_size=6144, vocab_size=32768, rope_theta=10000.0)


class CopyReceiver:
    """Receiver process for the benchmark: owns one tensor per name and copies each bucket entry
    into it (the one device copy a real engine's load does), then synchronizes before acking."""

    def __init__(self, specs: dict, device: str):
        self.device = torch.device(device)
        self.specs = specs
        self.params = {n: torch.empty(s, dtype=d, device=self.device) for n, (s, d) in specs.items()}
        self.version = None
        self.base = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def capabilities(self):
        return frozenset({"cuda_ipc"} if self.device.type == "cuda" else {"shm"})

    def param_specs(self):
        return self.specs

    def begin_update(self, version):
        pass

    def load_bucket(self, entries, buffer):
        for n, t in unpack_bucket(buffer, entries).items():
            self.params[n].copy_(t, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def end_update(self, version, checksums):
        self.version = version

    def abort_update(self, version):
        pass

    def weight_version(self):
        return self.version

    def checksums(self, names=None):
        from colocate.buckets import tensor_checksum

        return {n: tensor_checksum(self.params[n]) for n in (names or self.params)}

    def extra_peak(self):
        return torch.cuda.max_memory_allocated() - self.base if self.device.type == "cuda" else 0


def _make_weights(specs: dict, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {n: torch.randn(s, generator=g, device=device, dtype=torch.float32).to(d) for n, (s, d) in specs.items()}


def bench_ipc(quick: bool) -> tuple[list[dict], dict]:
    cuda = torch.cuda.is_available() and not quick
    dev = "cuda" if cuda else "cpu"
    spec = QWEN3_8B if cuda else SMALL
    dtype = torch.bfloat16
    specs = hf_param_specs(spec, dtype=dtype)
    weights = _make_weights(specs, dev)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    timer = time_cuda if cuda else time_cpu
    rows: list[dict] = []

    def flat_copy() -> dict:
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        return timer(lambda: dst.copy_(src))

    def per_tensor_copy() -> dict:
        dst = {n: torch.empty_like(w) for n, w in weights.items()}
        return timer(lambda: [dst[n].copy_(w) for n, w in weights.items()])

    for provider, fn in (("d2d_flat", flat_copy), ("d2d_per_tensor", per_tensor_copy)):
        t = fn()
        rows.append({"case": "ipc", "provider": provider, "ms": t["p50"], "GBps": nbytes / t["p50"] / 1e6})
    if cuda:
        torch.cuda.empty_cache()

    bucket = (1 * GiB) if cuda else (256 << 10)
    recv = spawn_receiver(CopyReceiver, specs, dev, timeout_s=300)
    extra: dict = {"nbytes": nbytes, "num_tensors": len(weights), "bucket_bytes": bucket, "model": "Qwen3-8B shapes"
                   if cuda else "small"}
    try:
        pub = Publisher(recv, PublishConfig(transport="auto", bucket_bytes=bucket, max_in_flight=2, verify="none"))
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        version = iter(range(1, 10_000))
        first = pub.publish(weights, version=next(version))
        extra["handles_first_publish"] = first.handles
        extra["num_buckets"] = first.num_buckets
        reports = []

        def once():
            reports.append(pub.publish(weights, version=next(version)))
        t = time_cpu(once, warmup=1, iters=5 if cuda else 3)
        extra["handles_later_publishes"] = reports[-1].handles
        if cuda:
            extra["trainer_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
            extra["receiver_peak_extra_bytes"] = recv.call("extra_peak")
        phases = {k: sorted(r.timings[k] for r in reports)[len(reports) // 2] * 1e3 for k in reports[-1].timings}
        extra["phases_ms_median"] = phases
        rows.append({"case": "ipc", "provider": f"publisher_{pub.transport}", "ms": t["p50"],
                     "GBps": nbytes / t["p50"] / 1e6, **{f"{k}_ms": v for k, v in phases.items()}})
        ver = Publisher(recv, PublishConfig(transport="auto", bucket_bytes=bucket, verify="checksum"))
        ver.last_good = pub.last_good
        tv = time_cpu(lambda: ver.publish(weights, version=next(version)), warmup=0, iters=1)
        rows.append({"case": "ipc", "provider": f"publisher_{pub.transport}+sender_checksums", "ms": tv["p50"],
                     "GBps": nbytes / tv["p50"] / 1e6})
        got = recv.checksums(list(weights)[:3])
        from colocate.buckets import tensor_checksum

        assert got == {n: tensor_checksum(weights[n]) for n in got}, "receiver holds different bytes"
    finally:
        recv.close()
    base = rows[0]["ms"]
    for r in rows:
        r["x_vs_d2d_flat"] = r["ms"] / base
    return rows, extra


def bench_sglang() -> tuple[list[dict], dict]:
    import json

    from colocate.engines import build_hf_model, hf_checkpoint_views
    from colocate.sglang_engine import SGLangEngine, sglang_checksum

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = SGL_1GB
    d = tempfile.mkdtemp(prefix="sgl-bench-")
    torch.manual_seed(0)
    model = build_hf_model(spec, dtype=torch.bfloat16, device="cuda")
    model.save_pretrained(d, safe_serialization=True)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    torch.manual_seed(1)
    weights = {n: (0.02 * torch.randn_like(v, dtype=torch.float32)).to(torch.bfloat16)
               for n, v in hf_checkpoint_views(model).items()}
    del model
    torch.cuda.empty_cache()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    eng = SGLangEngine.launch(spec=spec, model_path=d, skip_tokenizer_init=True, attention_backend="triton",
                              sampling_backend="pytorch", grammar_backend="none", mem_fraction_static=0.3,
                              max_total_tokens=65536, dtype="bfloat16", random_seed=0, log_level="error",
                              disable_cuda_graph=True)
    rows: list[dict] = []
    sums = {}
    try:
        e = eng.engine

        def naive_loop():
            for n, t in weights.items():
                e.update_weights_from_tensor(named_tensors=[(n, t)], load_format=None, flush_cache=False)
            e.flush_cache()

        def one_call():
            e.update_weights_from_tensor(named_tensors=list(weights.items()), load_format=None, flush_cache=True)

        pub = Publisher(eng, PublishConfig(transport="auto", bucket_bytes=512 << 20))
        version = iter(range(1, 10_000))

        def ours():
            pub.publish(weights, version=next(version))

        for name, fn in (("naive_per_tensor_loop", naive_loop), ("single_call_all_tensors", one_call),
                         ("publisher_buckets", ours)):
            t = time_cpu(fn, warmup=1, iters=3)
            sums[name] = sglang_checksum(e)
            rows.append({"case": "sglang", "provider": name, "ms": t["p50"], "GBps": nbytes / t["p50"] / 1e6})
    finally:
        eng.shutdown()
    base = rows[0]["ms"]
    for r in rows:
        r["x_vs_naive"] = r["ms"] / base
    if len(set(sums.values())) != 1:
        raise RuntimeError(f"SGLang checksums differ between methods: {sums}")
    return rows, {"nbytes": nbytes, "num_tensors": len(weights), "checksum": next(iter(sums.values()))}


def _plot(rows: list[dict], name: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the SGLang carry (go.sh) may not include matplotlib: JSON + table still written
        print(f"note: matplotlib missing, {name}.png not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["provider"] for r in rows], [r["GBps"] for r in rows])
    ax.set_xlabel("payload GB/s (higher is better)")
    ax.set_title(name)
    fig.tight_layout()
    fig.savefig(out_dir() / f"{name}.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small CPU smoke run (shared-memory transport)")
    ap.add_argument("--sglang", action="store_true", help="publish into a real SGLang engine (GPU + sglang)")
    args = ap.parse_args()
    t0 = time.time()
    if args.sglang:
        rows, extra = bench_sglang()
        name, cols = "publish_sglang", ["case", "provider", "ms", "GBps", "x_vs_naive"]
    else:
        rows, extra = bench_ipc(args.quick)
        name, cols = "publish", ["case", "provider", "ms", "GBps", "x_vs_d2d_flat"]
    extra["wall_s"] = time.time() - t0
    path = write_results(name, rows, extra)
    _plot(rows, name)
    print(f"wrote {path}")
    print({k: v for k, v in extra.items() if k != "phases_ms_median"})
    if "phases_ms_median" in extra:
        print("phases (ms, median):", {k: round(v, 3) for k, v in extra["phases_ms_median"].items()})
    print_table(rows, cols)


if __name__ == "__main__":
    main()
