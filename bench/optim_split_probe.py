"""Where the host/slot split of ``StagedAdamW`` loses its time (issue #23), on the ``--peers``
parameter set of ``bench.optim_staged`` (1e9 fp32 params in 64 tensors, AdamW, fp32 moments).

Three measurements, one run:

* ``layout``: host AdamW (``torch._fused_adamw_``) per 1e9 params on 256 Mi elements held four
  ways: state slabs registered with ``cudaHostRegister`` on 4 KiB pages and on transparent huge
  pages (:func:`optim_staged.slabs.host_zeros`), ``pin_memory=True`` tensors (cudaHostAlloc) and
  pageable tensors, at 16 Mi elements per call with every intra-op thread; for pinned memory also
  the link's GB/s (H2D, D2H, both at once).
* ``contention``: the same host AdamW while a second thread streams pinned 64 MiB copies both ways
  (as the slot lane does), for several thread counts: host rate, and the link's GB/s per direction
  inside the AdamW window against the link alone. Tells DRAM sharing (link falls whatever the
  thread count) from CPU starvation (link falls only when every core runs AdamW).
* ``split``: ``StagedAdamW`` with offloaded gradients at fixed host shares x host-lane threads
  (slots 3 x 4 Mi, budget 4x the largest gradient) and ``offload_plan()`` fits, ``--runs``
  interleaved; min ms of backward + step + synchronize and the allocated transient.

Run on the GPU box: ``python -m bench.optim_split_probe`` (~2 min); ``--quick`` on CPU (split rows
only). Writes ``optim_split_probe.json``."""

from __future__ import annotations

import argparse
import gc
import threading
import time

import torch

from bench._common import print_table, write_results
from bench.optim_staged import (
    CUDA,
    SlotConfig,
    StagedAdamW,
    _Harness,
    bandwidth,
    geometric_sizes,
    host_adamw_pass,
    use_config,
)
from optim_staged.slabs import StateSlabs

BATCH = 16 << 20


def _adamw_ms(ts, n: int) -> float:
    """One host-lane AdamW pass over ``ts`` (keys p, g, m, v; ``n`` elements each), wall ms."""
    t0 = time.perf_counter()
    host_adamw_pass(ts["p"], ts["g"], ts["m"], ts["v"], BATCH)
    return (time.perf_counter() - t0) * 1e3


class _LinkLoad:
    """A thread streaming pinned ``chunk``-byte copies both ways (two CUDA streams) until stopped;
    ``rate(t0, t1)``: GB/s per direction of the copy pairs that finished inside [t0, t1]."""

    def __init__(self, chunk: int = 64 << 20) -> None:
        self.chunk = chunk
        self.h = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.d = [torch.empty(chunk, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.s = [torch.cuda.Stream() for _ in range(2)]
        self.done: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with torch.cuda.stream(self.s[0]):
                self.d[0].copy_(self.h[0], non_blocking=True)
            with torch.cuda.stream(self.s[1]):
                self.h[1].copy_(self.d[1], non_blocking=True)
            self.s[0].synchronize()
            self.s[1].synchronize()
            self.done.append(time.perf_counter())

    def __enter__(self):
        self._t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def rate(self, t0: float, t1: float) -> float:
        k = sum(t0 <= t <= t1 for t in self.done)
        return k * self.chunk / (t1 - t0) / 1e9


def layout_rows(n: int, threads: int) -> list[dict]:
    """Host AdamW per 1e9 params (and, for pinned memory, the link's rates) on four host layouts."""
    torch.set_num_threads(threads)
    rows = []
    for kind in ("slab_4k_registered", "slab_thp_registered", "pin_memory", "pageable"):
        if kind.startswith("slab"):  # the optimizer's own slabs, pinned by registration
            ts = StateSlabs("pgmv", n, pin=CUDA, huge_pages=kind == "slab_thp_registered")
        else:
            ts = {k: torch.zeros(n, dtype=torch.float32, pin_memory=(kind == "pin_memory" and CUDA)) for k in "pgmv"}
        _adamw_ms(ts, n)
        ms = min(_adamw_ms(ts, n) for _ in range(3))
        row = {"case": "layout", "provider": kind, "threads": threads, "ms_per_1e9": ms * 1e9 / n}
        if CUDA and kind != "pageable":
            bw = bandwidth(0, host_memory=ts["m"])
            row.update(h2d_GBps=bw["h2d"], d2h_GBps=bw["d2h"], duplex_GBps_dir=bw["duplex_per_dir"])
        rows.append(row)
        del ts
        gc.collect()  # unregister (slabs) and free before the next layout allocates
    return rows


def contention_rows(n: int, thread_counts: list[int]) -> list[dict]:
    ts = StateSlabs("pgmv", n, pin=True, huge_pages=True)
    rows = []
    with _LinkLoad() as link:
        time.sleep(1.0)
        t1 = time.perf_counter()
        alone = link.rate(t1 - 1.0, t1)
    rows.append({"case": "contention", "provider": "link_alone", "link_GBps_dir": alone})
    for k in thread_counts:
        torch.set_num_threads(k)
        _adamw_ms(ts, n)
        solo = min(_adamw_ms(ts, n) for _ in range(2))
        with _LinkLoad() as link:
            t0 = time.perf_counter()
            ms = _adamw_ms(ts, n)
            t1 = time.perf_counter()
            under = link.rate(t0, t1)
        rows.append({"case": "contention", "provider": f"host_adamw_{k}t", "threads": k,
                     "ms_per_1e9": solo * 1e9 / n, "ms_per_1e9_with_link": ms * 1e9 / n,
                     "link_GBps_dir": under, "link_frac_of_alone": under / alone})
    return rows


def split_rows(n: int, count: int, runs: int, quick: bool) -> tuple[list[dict], dict]:
    sizes = geometric_sizes(n, count, max(1, int(n * 1.07e6 / 1e9)))
    h = _Harness(sizes)
    big = 4 * max(sizes)
    opts = {}
    for hp in (True, False):  # slabs on transparent huge pages, and on 4 KiB pages
        slots = SlotConfig(slot_numel=1 << 16, huge_pages=hp) if quick else SlotConfig(huge_pages=hp)
        ps = h.params()
        opts[hp] = (ps, StagedAdamW(ps, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, slots=slots,
                                    host_fraction=0.5), slots)
    configs: dict[str, dict] = {}
    for hp in (True, False):
        tag = "thp" if hp else "4k"
        configs[f"{tag}_split0"] = dict(hp=hp, host_fraction=0.0, host_threads=None)
        min_slots = (1 << 20, 2 << 20, 4 << 20) if hp else (1 << 20,)
        for min_slot in min_slots:
            share, fit = opts[hp][1].offload_plan(min_slot_numel=(1 << 14) if quick else min_slot)
            for th in ((4, 8, None) if hp else (None,)):
                configs[f"{tag}_fit{min_slot >> 20}Mi_t{th or 'all'}"] = dict(hp=hp, host_fraction=share,
                                                                             host_threads=th, slots=fit)
    for share in (0.12, 0.2, 0.3):
        configs[f"thp_split{share:g}_t8"] = dict(hp=True, host_fraction=share, host_threads=8)
    for c in configs.values():
        c.update(offload_gradients=True, budget=4 * big)

    times = {k: [] for k in configs}
    trans = dict.fromkeys(configs, 0)
    shares: dict[str, float] = {}
    for r in range(runs):
        for name, c in configs.items():
            ps, opt, slots = opts[c["hp"]]
            use_config(opt, c, slots)
            shares[name] = opt.split
            ms, tr = h.measured_iteration(ps, opt)
            times[name].append(ms)
            trans[name] = max(trans[name], tr)
        print(f"round {r + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in times.items()), flush=True)
    rows = []
    for name, c in configs.items():
        t = sorted(times[name])
        s = c.get("slots", opts[c["hp"]][2])
        rows.append({"case": "split", "provider": name, "ms": t[0], "ms_p50": t[len(t) // 2],
                     "host_fraction": round(shares[name], 3), "threads": c["host_threads"] or "all",
                     "slots": f"{s.num_slots}x{s.slot_numel / 2**20:.2f}Mi", "transient_GiB": trans[name] / 2**30,
                     "within_largest_grad": trans[name] <= big + (1 << 20)})
    return rows, {"largest_grad_GiB": big / 2**30, "sizes": [min(sizes), max(sizes)], "count": count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run: split rows only)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows: list[dict] = []
    threads0 = torch.get_num_threads()
    extra: dict = {"threads": threads0}
    if CUDA and not args.quick:
        extra["bandwidth_GBps"] = bandwidth(1 << 30)
        rows += layout_rows(256 << 20, threads0)
        rows += contention_rows(256 << 20, sorted({4, 8, max(1, threads0 - 1)}))
        torch.set_num_threads(threads0)
        print_table(rows, ["case", "provider", "threads", "ms_per_1e9", "h2d_GBps", "d2h_GBps", "duplex_GBps_dir",
                           "ms_per_1e9_with_link", "link_GBps_dir", "link_frac_of_alone"])
    n, count = (4_000_000, 16) if args.quick else (1_000_000_000, 64)
    srows, sextra = split_rows(n, count, 2 if args.quick else args.runs, args.quick)
    rows += srows
    extra.update(sextra)
    path = write_results("optim_split_probe", rows, extra)
    print(f"wrote {path}")
    print_table(srows, ["provider", "ms", "ms_p50", "host_fraction", "threads", "slots", "transient_GiB",
                        "within_largest_grad"])


if __name__ == "__main__":
    main()
