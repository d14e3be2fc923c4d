"""Where the host spends the hybrid model's tree step (GPU diagnostic for issue #22 item 5).

Builds ``bench.harts_gdn``'s Qwen3-Next-width hybrid GPT (``GGGA`` × 2) on the ρ = 0.75 GRPO group and
runs the ``tree`` step with CUDA graphs on and off. Forward hooks time each module's forward on the host
(no device synchronization inside the step), and the GDN layer's own pieces (tree convolution, input
preparation, g/β, the tree recurrence, the gated norm, the graphed recurrence calls and their captures)
are timed by wrapping them; a graphed call's host time is split into the wrapped FLA function (its eager
first calls and its run under capture), the captures and ``CUDAGraph.replay``. Forward hooks on modules
that Megatron calls inside a compiled region (the gated norm's ``out_norm``) make dynamo recompile that
region up to its recompile limit: such regions' times are upper bounds. Prints, per setting, the forward /
backward issue time and wall time of 5 steps (after 3 warm-up steps), the Python garbage collector's
collections and time per step, and the host milliseconds per step of the 45 largest items; the
same steps again with the collector frozen and off (Megatron's ``--manual-gc``); and first the host
cost of single operations on this machine (microseconds per call, no synchronization), so boxes can
be compared.

Run on the GPU box with the lane's environment (carried wheels on ``PYTHONPATH``, tilelang for FLA's
GDN backward; docs/gpu-lane.md)::

    python3 scripts/gdn_host_probe.py
"""

from __future__ import annotations

import collections
import gc
import sys
import time

import torch

from harts.gdn_graphs import GraphPool


def op_costs(n: int = 2000) -> dict[str, float]:
    """Host microseconds per call of single operations on small CUDA tensors (no synchronization inside)."""
    a = torch.randn(64, 64, device="cuda")
    b = torch.randn(64, 64, device="cuda")
    ag = a.clone().requires_grad_()
    idx = torch.arange(32, device="cuda")
    lin = torch.nn.Linear(64, 64, device="cuda")
    graph, static = torch.cuda.CUDAGraph(), a.clone()
    GraphPool(a.device).capture(graph, lambda: [static.add_(1.0) for _ in range(20)])
    ops = {
        "add": lambda: a + b,
        "add (requires grad)": lambda: ag + b,
        "copy_": lambda: static.copy_(a),
        "clone": lambda: a.clone(),
        "empty": lambda: torch.empty(64, 64, device="cuda"),
        "index_select": lambda: a.index_select(0, idx),
        "nn.Linear (requires grad)": lambda: lin(a),
        "CUDAGraph.replay (20 kernels)": graph.replay,
    }
    out = {}
    for name, fn in ops.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
    return out


def main() -> None:
    sys.argv = sys.argv[:1]
    from bench import harts_gdn as hg
    from harts import gdn_graphs, gdn_megatron
    from harts.forest import build_forest
    from harts.gdn import GdnTreeConfig
    from harts.megatron import tree_forward

    if not torch.cuda.is_available():
        raise SystemExit("error: scripts/gdn_host_probe.py needs a CUDA device")
    print("host microseconds per call:")
    for k, v in op_costs().items():
        print(f"   {v:8.2f}  {k}")
    hg._setup()
    model, cfg = hg._model(False, "cuda", "GGGA" * 2, "qwen3-next")
    seqs = dict(hg._workloads(False, cfg.vocab_size))["rho=0.75"]
    acc: dict[str, float] = collections.defaultdict(float)
    cnt: dict[str, int] = collections.defaultdict(int)

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t
                cnt[name] += 1
        return wrapper

    starts: dict[str, float] = {}
    for name, m in model.named_modules():
        if not name or name.count(".") > 4:
            continue

        def pre(mod, args, name=name):
            starts[name] = time.perf_counter()

        def post(mod, args, out, name=name):
            acc["fwd " + name] += time.perf_counter() - starts[name]
            cnt["fwd " + name] += 1

        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    for fname in ("tree_causal_conv1d_fla", "_split_qkv", "tree_gated_delta_rule"):
        setattr(gdn_megatron, fname, timed("fn " + fname, getattr(gdn_megatron, fname)))
    cls = gdn_megatron.TreeGatedDeltaNet
    for meth in ("_compute_g_and_beta", "_apply_gated_norm"):
        setattr(cls, meth, timed("fn " + meth, getattr(cls, meth)))
    gdn_graphs._GraphedCall.__call__ = timed("fn graphed recurrence call", gdn_graphs._GraphedCall.__call__)
    gdn_graphs._GraphedCall._capture = timed("fn recurrence capture", gdn_graphs._GraphedCall._capture)
    eager_fn = gdn_graphs._GraphedCall.__init__

    def init(self, fn, graphs, name, **kw):
        eager_fn(self, timed("fn graphed call: eager or captured fn", fn), graphs, name, **kw)

    gdn_graphs._GraphedCall.__init__ = init
    torch.cuda.CUDAGraph.replay = timed("fn graphed call: CUDAGraph.replay", torch.cuda.CUDAGraph.replay)
    gc_stats = collections.Counter()
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
            gc_stats[f"gen{info['generation']}"] += 1
        else:
            gc_stats["ms"] += (time.perf_counter() - gc_start[0]) * 1e3

    gc.callbacks.append(on_gc)

    for cuda_graphs, manual_gc in ((True, False), (False, False), (True, True)):
        f = build_forest(seqs, device="cuda")
        params = gdn_megatron.make_gdn_tree_params(f, config=GdnTreeConfig(cuda_graphs=cuda_graphs), backend="varlen")

        def step(f=f, params=params):
            hg._fresh_graphs(params)
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out = tree_forward(model, f, params=params)
            loss = hg.step_loss(out, f)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t0) * 1e3

        for _ in range(3):
            step()
        if manual_gc:  # Megatron's --manual-gc: the collector off during steps, long-lived objects frozen
            gc.collect()
            gc.freeze()
            gc.disable()
        acc.clear()
        cnt.clear()
        gc_stats.clear()
        steps = [step() for _ in range(5)]
        if manual_gc:
            gc.enable()
            gc.unfreeze()
        print(f"\n== cuda_graphs={cuda_graphs} manual_gc={manual_gc}: forward issue / backward issue / wall ms per step")
        for s in steps:
            print("   " + " ".join(f"{x:.2f}" for x in s))
        print("  garbage collector per step: " + ", ".join(f"{k} {v / len(steps):.2f}" for k, v in sorted(gc_stats.items())))
        print("  host ms per step (module forwards and wrapped functions), calls per step:")
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:45]:
            print(f"   {v * 1e3 / len(steps):8.3f}  x{cnt[k] // len(steps):<4} {k}")


if __name__ == "__main__":
    main()
