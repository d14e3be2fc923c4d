"""Weight publication: colocated CUDA IPC publish vs a device copy; SGLang publish vs naive loops.

Cases:
* ``ipc``: an 8B-class bf16 parameter set (Qwen3-8B shapes, 16.4 GB) held, as a Megatron DDP
  param buffer holds it, in one contiguous buffer in Megatron layout; the converter's HF stream
  (views of that buffer, fresh tensors only for the GQA q/k/v split) is published by
  :class:`colocate.publish.Publisher` from this (trainer) process to a receiver process on the
  same GPU that copies every tensor into its own parameters (``colocate.buckets.copy_tensors``:
  one copy kernel per tensor ≥ 1 MiB, the small ones in one ``_foreach_copy_``; the 2026-11-30
  00:58 run used ``_foreach_copy_`` for all, earlier runs a loop; the receiver's copy was not
  what made those runs slow). Variants: ``packed`` (everything
  copied into 1 GiB buckets, ≤ 2 in flight: the old path), ``inplace`` (the buffer is shared as
  one IPC handle and only q/k/v are packed; the receiver unmaps it after each publish),
  ``inplace_keep_mapped`` (mapped across publishes: no handle after the first) and
  ``inplace_arena_keep_mapped`` (the converter writes q/k/v into a
  :class:`colocate.convert.ConversionArena` allocated once from the spec, 1.8 GB for 8B; buffer
  and arena both shared in place and kept mapped, so nothing is packed) and
  ``replay_arena_keep_mapped`` (the same with ``replay_sources=[buffer]``: after the first
  publish the converter stream is not read; the publisher re-runs the arena's recorded q/k/v
  copies and hands the same two storages over again; checked after a trainer step). Baselines in the
  same run: one device-to-device copy of the same bytes (``d2d_flat``, the copy floor) and a
  per-tensor ``copy_`` loop (``d2d_per_tensor``). Reported: payload GB/s, IPC handles, peak extra
  trainer memory, per-phase times.
* ``--sglang``: a ≈ 1.9 GB Qwen3 published into a real ``sglang.Engine`` by our publisher (packed,
  512 MiB buckets; in place, views of one storage) vs a naive per-tensor
  ``update_weights_from_tensor`` loop and one call with every tensor; SGLang's checksum must
  agree across methods and differ from the initial weights.
  Needs SGLang: ``bash .sgl/scripts/go.sh bench/publish.py --sglang``.
* ``--overhead`` (CPU): the publisher's fixed per-publish cost. Qwen3-8B's 399 HF tensors (same
  names, count and converter path: views of one Megatron-layout buffer, q/k/v split off) at tiny
  sizes (hidden 64, 3.5 MB in all), so copies are negligible and Python work dominates. Published
  in process and over shared memory to a receiver process, packed / in place / in place kept
  mapped / in place with a conversion arena, kept mapped / the same with replay (``share_min_bytes`` lowered to the
  arena's size there: the tiny arena is smaller than the 1 MiB used otherwise); reports ms per
  publish (wall, and ``cpu_ms``: the publishing thread's CPU time, which other processes on a
  shared machine do not inflate), the publisher's phases, ``untimed_ms`` (wall minus the phase
  sum), the converter stream alone (without and with the arena), and a cProfile top list (in-place, kept mapped, shm).

Run: ``python -m bench.publish`` (H200, ~1 min), ``python -m bench.publish --quick`` (CPU smoke:
shared-memory transport, small set), ``python -m bench.publish --overhead`` (CPU, ~1 min). Writes ``publish.json`` / ``publish.png`` (or
``publish_sglang.*``, ``publish_overhead.*``) into ``$OUT`` (or ``outputs/bench``); prints a table last.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import tempfile
import time
from pathlib import Path

import torch

from bench._common import out_dir, print_table, time_cpu, time_cuda, write_results
from colocate import HFModelSpec, PublishConfig, Publisher
from colocate.buckets import tensor_checksum
from colocate.convert import ConversionArena, hf_param_specs, megatron_to_hf
from colocate.receivers import TensorReceiver
from colocate.transports import spawn_receiver

GiB = 1 << 30
QWEN3_8B = HFModelSpec(arch="qwen3", num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                       head_dim=128, ffn_hidden_size=12288, vocab_size=151936)
SMALL = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                    head_dim=64, ffn_hidden_size=512, vocab_size=4096)
# Qwen3-8B's tensor count and names (36 layers, GQA 32/8) at tiny sizes: fixed costs only
QWEN3_8B_TINY = HFModelSpec(arch="qwen3", num_layers=36, hidden_size=64, num_attention_heads=32, num_query_groups=8,
                            head_dim=2, ffn_hidden_size=192, vocab_size=256)
SGL_1GB = HFModelSpec(arch="qwen3", num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                      head_dim=128, ffn_hidden_size=6144, vocab_size=32768, rope_theta=10000.0)


class CopyReceiver(TensorReceiver):
    """Receiver process for the benchmark: :class:`colocate.TensorReceiver` (copies every tensor
    into its own, small ones batched; kept-mapped views built once) plus its peak extra memory."""

    def __init__(self, specs: dict, device: str):
        super().__init__(specs, device)
        self.base = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def extra_peak(self):
        return torch.cuda.max_memory_allocated() - self.base if self.device.type == "cuda" else 0


def _megatron_params(spec: HFModelSpec) -> dict[str, tuple[int, ...]]:
    """Megatron-Core parameter names and shapes (TP=1, local layer norms) of a dense Qwen3."""
    H, Q, G, D, F = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups, spec.head_dim, spec.ffn_hidden_size
    out = {"embedding.word_embeddings.weight": (spec.vocab_size, H)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "self_attention.linear_qkv.weight": ((Q + 2 * G) * D, H),
                    p + "self_attention.q_layernorm.weight": (D,), p + "self_attention.k_layernorm.weight": (D,),
                    p + "self_attention.linear_proj.weight": (H, Q * D), p + "pre_mlp_layernorm.weight": (H,),
                    p + "mlp.linear_fc1.weight": (2 * F, H), p + "mlp.linear_fc2.weight": (H, F)})
    out["decoder.final_layernorm.weight"] = (H,)
    if not spec.tie_embeddings:
        out["output_layer.weight"] = (spec.vocab_size, H)
    return out


def param_buffer(spec: HFModelSpec, device: str, dtype: torch.dtype = torch.bfloat16
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One contiguous buffer holding every Megatron parameter (as a DDP param buffer does) and
    the parameters as views into it, filled with random values."""
    shapes = _megatron_params(spec)
    total = sum(math.prod(s) for s in shapes.values())
    flat = torch.empty(total, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for start in range(0, total, 1 << 28):
        n = min(1 << 28, total - start)
        flat[start: start + n] = torch.randn(n, generator=g, device=device, dtype=torch.float32).to(dtype)
    params, off = {}, 0
    for n, s in shapes.items():
        params[n] = flat[off: off + math.prod(s)].view(s)
        off += math.prod(s)
    return flat, params


def hf_stream(params: dict[str, torch.Tensor], spec: HFModelSpec, arena: ConversionArena | None = None):
    """The converter's HF-name stream: views of the buffer where the layout allows (norms,
    o/down projections, gate/up halves, embeddings), fresh tensors for the GQA q/k/v split, or,
    with ``arena`` (reset here, as ``iter_hf_weights`` does), views of the arena for those."""
    if arena is not None:
        arena.reset()
    for n, t in params.items():
        yield from megatron_to_hf(n, t, spec=spec, arena=arena)


def _check_received(recv, params: dict[str, torch.Tensor], spec: HFModelSpec, names: list[str]) -> None:
    """The receiver holds the trainer's current bytes for ``names`` (a fresh conversion)."""
    hf = dict(hf_stream(params, spec))
    if recv.checksums(names) != {n: tensor_checksum(hf[n]) for n in names}:
        raise RuntimeError("receiver holds different bytes than the trainer sent")


def bench_ipc(quick: bool) -> tuple[list[dict], dict]:
    cuda = torch.cuda.is_available() and not quick
    dev = "cuda" if cuda else "cpu"
    spec = QWEN3_8B if cuda else SMALL
    dtype = torch.bfloat16
    specs = hf_param_specs(spec, dtype=dtype)
    flat, params = param_buffer(spec, dev)
    if not cuda:
        flat.share_memory_()  # the shm transport shares storages that live in shared memory
    meta = {n: (tuple(t.shape), t.dtype) for n, t in hf_stream(params, spec)}
    nbytes = sum(math.prod(s) * 2 for s, _ in meta.values())
    timer = time_cuda if cuda else time_cpu
    rows: list[dict] = []

    def flat_copy() -> dict:
        dst = torch.empty_like(flat)
        return timer(lambda: dst.copy_(flat))

    def per_tensor_copy() -> dict:
        src = dict(hf_stream(params, spec))
        dst = {n: torch.empty_like(w) for n, w in src.items()}
        return timer(lambda: [dst[n].copy_(w) for n, w in src.items()])

    for provider, fn in (("d2d_flat", flat_copy), ("d2d_per_tensor", per_tensor_copy)):
        t = fn()
        rows.append({"case": "ipc", "provider": provider, "ms": t["p50"], "GBps": nbytes / t["p50"] / 1e6})
        if cuda:
            torch.cuda.empty_cache()

    bucket = (1 * GiB) if cuda else (256 << 10)
    share = (64 << 20) if cuda else (1 << 20)
    arena = ConversionArena.for_spec(spec, dtype=dtype, device=dev, share_memory=not cuda)  # once, reused
    recv = spawn_receiver(CopyReceiver, specs, dev, timeout_s=300)
    extra: dict = {"nbytes": nbytes, "num_tensors": len(meta), "bucket_bytes": bucket, "share_min_bytes": share,
                   "arena_bytes": arena.capacity, "model": "Qwen3-8B shapes" if cuda else "small",
                   "phases_ms_median": {}}
    version = iter(range(1, 10_000))
    checked = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
               "model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight"]
    try:
        variants = (("publisher_packed", {"share_min_bytes": None}, None),
                    ("publisher_inplace", {"share_min_bytes": share}, None),
                    ("publisher_inplace_keep_mapped", {"share_min_bytes": share, "keep_shared": True}, None),
                    # the small CPU arena (0.5 MB) is below the 1 MiB threshold: lowered to its size
                    ("publisher_inplace_arena_keep_mapped",
                     {"share_min_bytes": min(share, arena.capacity), "keep_shared": True}, arena),
                    # the same, and every publish after the first (the warm-up) a replay
                    ("publisher_replay_arena_keep_mapped",
                     {"share_min_bytes": min(share, arena.capacity), "keep_shared": True, "replay_sources": [flat],
                      "arena": arena}, arena))
        for provider, kw, arn in variants:
            pub = Publisher(recv, PublishConfig(transport="auto", bucket_bytes=bucket, max_in_flight=2,
                                                verify="none"), **kw)
            pub.last_good = next(version)
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            reports, cpus = [], []

            def once(pub=pub, reports=reports, cpus=cpus, arn=arn):
                c0 = time.thread_time()
                reports.append(pub.publish(hf_stream(params, spec, arn), version=next(version), meta=meta))
                cpus.append(time.thread_time() - c0)
            t = time_cpu(once, warmup=1, iters=5 if cuda else 3)
            cpu_ms = _median(cpus[1:]) * 1e3  # this thread's CPU time: robust on a shared box
            _check_received(recv, params, spec, checked)
            if pub.arena is not None:  # a replay after a trainer step carries the new values
                flat.neg_()
                once()
                _check_received(recv, params, spec, checked)
                flat.neg_()
            last = reports[-1]
            phases = {k: sorted(r.timings[k] for r in reports)[len(reports) // 2] * 1e3 for k in last.timings}
            extra["phases_ms_median"][provider] = phases
            rows.append({"case": "ipc", "provider": f"{provider}_{pub.transport}", "ms": t["p50"],
                         "GBps": nbytes / t["p50"] / 1e6, "handles_first": reports[0].handles,
                         "handles_later": last.handles, "buckets": last.num_buckets,
                         "shared_storages": last.num_shared,
                         "trainer_peak_extra_MiB": ((torch.cuda.max_memory_allocated() - base) / 2**20) if cuda else 0.0,
                         "arena_MiB": arena.capacity / 2**20 if arn is not None else 0.0,
                         "replayed": sum(r.replayed for r in reports), "cpu_ms": cpu_ms,
                         **{f"{k}_ms": v for k, v in phases.items()}})
            pub.release_staging()
            if cuda:
                torch.cuda.empty_cache()
        ver = Publisher(recv, PublishConfig(transport="auto", bucket_bytes=bucket, verify="checksum"),
                        share_min_bytes=share)
        ver.last_good = next(version)
        flat.neg_()  # new values (exact in bf16): the receiver can only match them through this publish
        tv = time_cpu(lambda: ver.publish(hf_stream(params, spec), version=next(version), meta=meta),
                      warmup=0, iters=1)
        rows.append({"case": "ipc", "provider": f"publisher_inplace_{ver.transport}+sender_checksums",
                     "ms": tv["p50"], "GBps": nbytes / tv["p50"] / 1e6})
        ver.release_staging()
        if cuda:
            extra["receiver_peak_extra_MiB"] = recv.call("extra_peak") / 2**20
        # the receiver holds the converted bytes: converted (q, v) and in-place (o_proj, up) tensors
        _check_received(recv, params, spec, checked + ["model.layers.1.mlp.up_proj.weight"])
    finally:
        recv.close()
    base = rows[0]["ms"]
    for r in rows:
        r["x_vs_d2d_flat"] = r["ms"] / base
    return rows, extra


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _profile_top(fn, iters: int, top: int = 15) -> list[dict]:
    """The ``top`` functions by own time (ms and calls per ``fn`` call) under cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, ncalls, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}({func})", "calls": nc / iters, "tottime_ms": tt / iters * 1e3,
             "cumtime_ms": ct / iters * 1e3} for (f, line, func), (_, nc, tt, ct, _) in rows]


def bench_overhead(iters: int = 50) -> tuple[list[dict], dict]:
    """Fixed per-publish CPU cost of 399 tiny tensors (see module docstring, ``--overhead``)."""
    spec = QWEN3_8B_TINY
    specs = hf_param_specs(spec, dtype=torch.bfloat16)
    flat, params = param_buffer(spec, "cpu")
    flat.share_memory_()
    meta = {n: (tuple(t.shape), t.dtype) for n, t in hf_stream(params, spec)}
    share = 1 << 20  # the 3.5 MB buffer goes in place, the split q/k/v (≤ 8 KiB storages) are packed
    arena = ConversionArena.for_spec(spec, dtype=torch.bfloat16, share_memory=True)  # 0.4 MB, allocated once
    stream = time_cpu(lambda: list(hf_stream(params, spec)), warmup=3, iters=iters)
    stream_arena = time_cpu(lambda: list(hf_stream(params, spec, arena)), warmup=3, iters=iters)
    rows: list[dict] = [{"case": "overhead", "provider": "converter_stream_only", "ms": stream["p50"]},
                        {"case": "overhead", "provider": "converter_stream_arena", "ms": stream_arena["p50"]}]
    extra: dict = {"num_tensors": len(meta), "nbytes": flat.numel() * 2, "share_min_bytes": share, "iters": iters,
                   "arena_bytes": arena.capacity, "model": "Qwen3-8B names/count, hidden 64", "phases_ms_median": {}}
    version = iter(range(1, 1_000_000))
    remote = spawn_receiver(CopyReceiver, specs, "cpu", timeout_s=60)
    try:
        for transport, recv in (("inprocess", CopyReceiver(specs, "cpu")), ("shm", remote)):
            for variant, kw, arn in (("packed", {"share_min_bytes": None}, None),
                                     ("inplace", {"share_min_bytes": share}, None),
                                     ("inplace_keep_mapped", {"share_min_bytes": share, "keep_shared": True}, None),
                                     ("inplace_arena_keep_mapped",  # arena 0.4 MB < 1 MiB: threshold lowered to it
                                      {"share_min_bytes": arena.capacity, "keep_shared": True}, arena),
                                     ("replay_arena_keep_mapped",
                                      {"share_min_bytes": arena.capacity, "keep_shared": True,
                                       "replay_sources": [flat], "arena": arena}, arena)):
                pub = Publisher(recv, PublishConfig(transport=transport, bucket_bytes=1 * GiB, max_in_flight=2,
                                                    verify="none"), **kw)
                walls: list[float] = []
                cpus: list[float] = []
                reports = []

                def once(pub=pub, walls=walls, cpus=cpus, reports=reports, arn=arn):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    reports.append(pub.publish(hf_stream(params, spec, arn), version=next(version), meta=meta))
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.thread_time() - c0)
                for _ in range(5):  # warm-up (first handles, staging buffers, caches)
                    once()
                del walls[:], cpus[:], reports[:]
                for _ in range(iters):
                    once()
                phases = {k: _median([r.timings[k] for r in reports]) * 1e3 for k in reports[-1].timings}
                untimed = _median([w - sum(r.timings.values()) for w, r in zip(walls, reports)]) * 1e3
                provider = f"publisher_{variant}_{transport}"
                extra["phases_ms_median"][provider] = phases
                rows.append({"case": "overhead", "provider": provider, "ms": _median(walls) * 1e3,
                             "cpu_ms": _median(cpus) * 1e3, "untimed_ms": untimed, "buckets": reports[-1].num_buckets,
                             "shared_storages": reports[-1].num_shared, **{f"{k}_ms": v for k, v in phases.items()}})
                if variant == "inplace_keep_mapped" and transport == "shm":
                    extra["profile_top"] = _profile_top(once, max(iters // 2, 1))
                pub.release_staging()
    finally:
        remote.close()
    return rows, extra


_SGL_DEVICE, _SGL_SPEC = "cuda", SGL_1GB  # (a CPU dry run of the harness swaps these)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_sglang(rounds: int = 7) -> tuple[list[dict], dict]:
    """Publish into a real in-process ``sglang.Engine``: our publisher against SGLang's own
    single ``update_weights_from_tensor`` call with every tensor, on the same tensors (views of
    one CUDA storage, as in a DDP param buffer), ``rounds`` interleaved rounds (the order rotates
    each round), min and median per method. Two weight sets A/B alternate, so every call changes
    the engine's weights. After every call the source storage is overwritten at once (negated,
    exact, undone after) and SGLang's checksum read (untimed) must equal the one of the set
    just published: the call returned only after the engine's copies ran."""
    from colocate.sglang_clients import flattened_bucket
    from colocate.sglang_engine import SGLangEngine, sglang_engine_args, write_hf_checkpoint

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = _SGL_SPEC
    specs = hf_param_specs(spec, dtype=torch.bfloat16)
    d = os.path.join(tempfile.mkdtemp(prefix="sgl-bench-"), "init")
    g = torch.Generator().manual_seed(0)
    write_hf_checkpoint(d, {n: (0.02 * torch.randn(s, generator=g)).to(dt) for n, (s, dt) in specs.items()},
                        spec=spec)
    total = sum(math.prod(s) for s, _ in specs.values())
    nbytes = total * 2

    def views_of(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev = _SGL_DEVICE
        flat = (0.02 * torch.randn(total, device=dev, generator=torch.Generator(device=dev).manual_seed(seed))
                ).to(torch.bfloat16)
        if dev == "cpu":
            flat.share_memory_()
        views, off = {}, 0
        for n, (s, _) in specs.items():
            views[n] = flat[off: off + math.prod(s)].view(s)
            off += math.prod(s)
        return flat, views

    sets = {"A": views_of(1), "B": views_of(2)}
    eng = SGLangEngine.launch(spec=spec, flattened=False, **sglang_engine_args(d, cuda_graph=False, memory_saver=False))
    # adapters over the same engine: one tensor per name (``eng``, the default before 2026-12-01's
    # run), the same with SGLang's checksum read at commit, and flattened_bucket hand-overs
    checked = SGLangEngine(eng.client, spec=spec, commit_checksum=True, flattened=False)
    flat_eng = SGLangEngine(eng.client, spec=spec, flattened=True)
    e = eng.client.engine  # the sglang.Engine itself, for its own calls
    version = iter(range(1, 1_000_000))
    runs: list[dict] = []
    phases: dict[str, list[dict]] = {}
    try:
        initial = eng.checksum()
        ref = {}
        for k, (_, views) in sets.items():  # reference checksums, taken well after the load
            e.update_weights_from_tensor(named_tensors=list(views.items()), load_format=None, flush_cache=True)
            _sync()
            time.sleep(0.5)
            ref[k] = eng.checksum()
        if len({initial, *ref.values()}) != 3:
            raise RuntimeError(f"checksums of the initial weights and sets A/B must differ: {initial} {ref}")
        pubs = {"publisher_inplace": Publisher(eng, PublishConfig(bucket_bytes=512 << 20)),
                "publisher_inplace_flattened": Publisher(flat_eng, PublishConfig(bucket_bytes=512 << 20)),
                "publisher_inplace_checksum": Publisher(checked, PublishConfig(bucket_bytes=512 << 20)),
                "publisher_packed": Publisher(eng, PublishConfig(bucket_bytes=512 << 20), share_min_bytes=None)}

        def ours(name: str):
            def run(views):
                v = next(version)
                for p in pubs.values():
                    p.last_good = v - 1
                rep = pubs[name].publish(views, version=v)
                phases.setdefault(name, []).append({k: x * 1e3 for k, x in rep.timings.items()})
            return run

        def single_call(views):
            e.update_weights_from_tensor(named_tensors=list(views.items()), load_format=None, flush_cache=True)

        def single_call_checksum(views):
            single_call(views)
            eng.checksum()

        def single_call_then_flush_request(views):  # the pre-2026-12-01 adapter's calls, minus the checksum
            e.update_weights_from_tensor(named_tensors=list(views.items()), load_format=None, flush_cache=False)
            e.flush_cache()

        def engine_flattened_call(views):  # SGLang's own flattened_bucket load of the same storage
            from colocate.buckets import Entry

            flat = sets[state][0]
            entries = [Entry(n, t.dtype, tuple(t.shape), t.storage_offset() * t.element_size()) for n, t in views.items()]
            eng.client.update_weights_from_bucket(flattened_bucket(flat.view(torch.uint8), entries), flush_cache=True)

        def naive_loop(views):
            for n, t in views.items():
                e.update_weights_from_tensor(named_tensors=[(n, t)], load_format=None, flush_cache=False)
            e.flush_cache()

        methods = {"engine_single_call": single_call, "publisher_inplace": ours("publisher_inplace"),
                   "engine_flattened_bucket_call": engine_flattened_call,
                   "publisher_inplace_flattened": ours("publisher_inplace_flattened"),
                   "engine_single_call+checksum": single_call_checksum,
                   "publisher_inplace_checksum": ours("publisher_inplace_checksum"),
                   "engine_single_call+flush_request": single_call_then_flush_request,
                   "publisher_packed": ours("publisher_packed"), "naive_per_tensor_loop": naive_loop}
        names = list(methods)
        failed: dict[str, str] = {}
        state = "B"
        for r in range(rounds + 1):  # round 0: warm-up, not reported
            order = names[r % len(names):] + names[: r % len(names)]
            row: dict = {"round": r, "order": order}
            for name in order:
                if name in failed:
                    continue
                state = "A" if state == "B" else "B"
                flat, views = sets[state]
                _sync()
                try:
                    t0 = time.perf_counter()
                    methods[name](views)
                    ms = (time.perf_counter() - t0) * 1e3
                except Exception as err:  # noqa: BLE001 - recorded; the other methods go on
                    failed[name] = f"{type(err).__name__}: {err}"[:2000]
                    print(f"{name} failed: {failed[name]}", flush=True)
                    eng.restore_from_disk(d)
                    state = "init"
                    continue
                flat.neg_()  # the trainer writes its storage the moment the call returns
                got = eng.checksum()
                flat.neg_()
                row[name] = ms
                row[name + ":copied"] = got == ref[state]
            for name, fn in (("flush_cache_request", e.flush_cache), ("checksum_request", eng.checksum)):
                _sync()
                t0 = time.perf_counter()
                fn()
                row[name] = (time.perf_counter() - t0) * 1e3
            if r:
                runs.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {row[k]:.2f}" for k in names + ["flush_cache_request",
                                                                                 "checksum_request"] if k in row),
                  flush=True)
    finally:
        eng.shutdown()
    rows = []
    for name in names + ["flush_cache_request", "checksum_request"]:
        xs = [run[name] for run in runs if name in run]
        if not xs:
            rows.append({"case": "sglang", "provider": name, "error": failed.get(name, "no run")})
            continue
        rows.append({"case": "sglang", "provider": name, "min_ms": min(xs), "median_ms": _median(xs),
                     "GBps": nbytes / min(xs) / 1e6 if name in names else None,
                     "copied_on_return": all(run.get(name + ":copied", True) for run in runs)})
    base = next(r for r in rows if r["provider"] == "engine_single_call")["min_ms"]
    for r in rows:
        if "min_ms" in r:
            r["x_vs_single_call"] = r["min_ms"] / base
    bad = [r["provider"] for r in rows if not r.get("copied_on_return", True)]
    ph = {n: {k: min(p[k] for p in ps[1:] or ps) for k in ps[0]} for n, ps in phases.items()}
    extra = {"model_bytes": nbytes, "num_tensors": len(specs), "rounds": rounds, "runs": runs,
             "publisher_phases_ms_min": ph, "checksums": {"initial": initial, **ref},
             "not_copied_on_return": bad, "failed": failed,
             "note": "every method ends when SGLang answered; '+checksum' rows also read SGLang's weight checksum "
                     "(a hash of every weight). After each call the source storage was overwritten at once and "
                     "the engine's checksum compared with the reference of the set published."}
    return rows, extra


def _write_single_call(rows: list[dict], extra: dict, header: dict | None = None) -> Path:
    """``publish_sglang_single_call.json``: our in-place publish with the adapter's default
    hand-over (``flattened_bucket``) against SGLang's single ``update_weights_from_tensor`` call
    with every tensor, both ending when SGLang answered; also the one-tensor-per-name variant."""
    from bench._common import machine_header

    ms = {r["provider"]: r.get("min_ms") for r in rows}
    keep = ("round", "publisher_inplace_flattened", "publisher_inplace", "engine_single_call",
            "engine_flattened_bucket_call", "publisher_inplace_checksum", "engine_single_call+checksum")
    path = out_dir() / "publish_sglang_single_call.json"
    path.write_text(json.dumps({
        "header": header or machine_header(), "model_bytes": extra["model_bytes"], "num_tensors": extra["num_tensors"],
        "publish_ms": ms.get("publisher_inplace_flattened"), "engine_single_call_ms": ms.get("engine_single_call"),
        "publish_variant": "publisher_inplace_flattened (SGLangEngine default: flattened=True)",
        "publish_named_ms": ms.get("publisher_inplace"),
        "engine_flattened_bucket_call_ms": ms.get("engine_flattened_bucket_call"),
        "publish_named_checksum_ms": ms.get("publisher_inplace_checksum"),
        "engine_single_call_checksum_ms": ms.get("engine_single_call+checksum"),
        "statistic": f"min over {extra['rounds']} interleaved rounds",
        "copied_on_return": not extra["not_copied_on_return"],
        "runs": [{k: v for k, v in run.items() if k in keep} for run in extra["runs"]]}, indent=1, default=str))
    return path


def _plot(rows: list[dict], name: str, metric: str = "GBps", label: str = "payload GB/s (higher is better)") -> None:
    try:
        import matplotlib
    except ImportError:  # the SGLang carry (go.sh) may not include matplotlib: JSON + table still written
        print(f"note: matplotlib missing, {name}.png not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["provider"] for r in rows], [r[metric] for r in rows])
    ax.set_xlabel(label)
    ax.set_title(name)
    fig.tight_layout()
    fig.savefig(out_dir() / f"{name}.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small CPU smoke run (shared-memory transport)")
    ap.add_argument("--sglang", action="store_true", help="publish into a real SGLang engine (GPU + sglang)")
    ap.add_argument("--overhead", action="store_true", help="fixed per-publish CPU cost of 399 tiny tensors")
    ap.add_argument("--iters", type=int, default=50, help="publishes timed per variant (--overhead)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per method (--sglang, >= 5)")
    args = ap.parse_args()
    t0 = time.time()
    if args.overhead:
        rows, extra = bench_overhead(args.iters)
        name, cols = "publish_overhead", ["case", "provider", "ms", "cpu_ms", "untimed_ms", "convert_ms", "begin_ms", "plan_ms", "bucket_ms",
                                          "transfer_ms", "load_ms", "verify_ms", "buckets", "shared_storages"]
    elif args.sglang:
        rows, extra = bench_sglang(args.rounds)
        name, cols = "publish_sglang", ["provider", "min_ms", "median_ms", "GBps", "x_vs_single_call", "copied_on_return"]
    else:
        rows, extra = bench_ipc(args.quick)
        name, cols = "publish", ["case", "provider", "ms", "cpu_ms", "GBps", "x_vs_d2d_flat", "handles_first", "handles_later",
                                 "shared_storages", "buckets", "trainer_peak_extra_MiB", "arena_MiB"]
    extra["wall_s"] = time.time() - t0
    path = write_results(name, rows, extra)
    if args.sglang:
        _write_single_call(rows, extra)
    if args.overhead:
        _plot(rows, name, "ms", "ms per publish of 399 tiny tensors (lower is better)")
    elif args.sglang:
        _plot([r for r in rows if r.get("GBps") is not None], name, "min_ms",
              f"ms per full publish of {extra['model_bytes'] / 1e9:.2f} GB, min of {args.rounds} (lower is better)")
    else:
        _plot(rows, name)
    print(f"wrote {path}")
    print({k: v for k, v in extra.items() if k not in ("phases_ms_median", "profile_top", "runs")})
    if "phases_ms_median" in extra:
        for provider, ph in extra["phases_ms_median"].items():
            print(f"phases (ms, median) {provider}:", {k: round(v, 3) for k, v in ph.items()})
    for r in extra.get("profile_top", []):
        print(f"profile {r['tottime_ms']:8.3f} ms own {r['cumtime_ms']:8.3f} ms cum {r['calls']:7.0f} calls  "
              f"{r['function']}")
    print_table(rows, cols)


if __name__ == "__main__":
    main()
