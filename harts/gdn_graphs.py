"""CUDA graphs of the FLA recurrence calls that the GDN layers of one microbatch share.

Every Gated DeltaNet layer of a microbatch runs the rounds of one :class:`harts.gdn.GdnPlan`: the same
``cu_seqlens``, chunk indices and shapes, only ``q, k, v, g, β`` and the start states differ. FLA's
host side (its Python, autotuner lookups and Triton's launcher for the 5 forward / 8 backward
kernels) costs about 1 ms per forward and 1.4 ms per backward call on an H200 host, as much as the
GPU spends on a 16k-token round (docs/harts_gdn.md). :class:`RoundGraphs` runs the first call of
each (round, direction) eagerly, which compiles and autotunes whatever is new, captures the second
in a CUDA graph and replays it for every later layer: the host then issues the copies into the
graph's static inputs, one graph launch and the copies out. Those copies cost about what the graphs
save: at Qwen3-Next widths the graphed step has a third more GPU operations than the eager one and
no lower wall time (docs/benchmarks.md, 2026-12-02 15:58).

The forward of a round is FLA's ``chunk_gated_delta_rule_fwd``: ``o``, the final states ``h_T`` and,
saved for the backward, the chunk-local cumulative gate ``g_c`` and the WY factor
``A = (I + tril(diag(β) K Kᵀ ⊙ Γ, −1))⁻¹`` per chunk; the backward is FLA's
``chunk_gated_delta_rule_bwd`` (it recomputes ``W, U`` and the chunk states from them). Both are
called directly, past FLA's backend dispatch and input guard (the same kernels the public
``chunk_gated_delta_rule`` runs without a FlashQLA install). A replay runs the captured kernels with
the configurations of the eager call: results are bitwise those of eager execution (GPU test).

Memory: the graphs of a microbatch share one ``torch.cuda.MemPool`` that holds their
intermediates (chunk states ``h``, ``v_new``, ``dh``, …) and outputs, plus static copies of one
call's inputs per graph, until the :class:`RoundGraphs` is dropped with the microbatch's
parameters. A pool that outlives the microbatch (``TreeGatedDeltaNet`` passes the one its layer
keeps) hands those blocks to the next microbatch's captures: without it every microbatch
allocates its graphs' memory with ``cudaMalloc`` afresh (measured 31 calls, 5.6 ms of host time
per step at Qwen3-Next widths) and frees it with ``cudaFree``, which waits for the device.

A pool is a :class:`GraphPool`: one capture stream, so the blocks of the previous microbatch's graphs
are reused, and an anchor graph, without which torch 2.11's pinned-host allocator fails an internal
assert on the first capture into a pool whose graphs have all been dropped (GPU test).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from harts.errors import GdnConfigError

__all__ = ["GraphPool", "RoundGraphs", "fla_round"]


def _fla_fwd(q, k, v, g, beta, h0, *, cu, chunk_indices, scale: float, chunk_size: int):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    gc, o, a, ht, _, _ = chunk_gated_delta_rule_fwd(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
        cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=chunk_size)
    return o.to(q.dtype), ht, gc, a


def _fla_bwd(q, k, v, gc, beta, a, h0, do, dht, *, cu, chunk_indices, scale: float, chunk_size: int):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    dq, dk, dv, db, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
        q=q, k=k, v=v, g=gc, beta=beta, A=a, scale=scale, initial_state=h0, do=do, dht=dht,
        cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=chunk_size)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, db.to(beta.dtype), dh0


class GraphPool:
    """Memory for CUDA graphs that are captured, dropped and captured again over a run: a
    ``torch.cuda.MemPool`` (``mempool``), the one stream every capture into it runs on (``stream``),
    and an anchor graph.

    * One stream: the caching allocator keeps a freed block for the stream it was allocated on, so
      captures on a new side stream each time could not reuse the blocks the previous microbatch's
      graphs left in the pool (measured: the pool grew by one microbatch's graph memory per
      microbatch).
    * The anchor, a graph of one kernel captured into the pool and kept as long as it: torch 2.11
      counts a pool's graphs twice, in the device allocator (where the ``MemPool`` object holds a
      count too) and in the pinned host allocator (where nothing else does). After the last graph of
      the pool is destroyed the host count is 0, and the next ``capture_begin`` into the pool fails
      ``TORCH_INTERNAL_ASSERT(use_count > 0)`` in ``CachingHostAllocator.h``, after which every later
      capture of the process fails too (GPU test). The anchor keeps that count at 1 or more.
    """

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        with torch.cuda.device(device):
            self.mempool = torch.cuda.MemPool()
            self.stream = torch.cuda.Stream(device)
            self._scratch = torch.zeros(1, device=device)
            self._anchor = torch.cuda.CUDAGraph()
            self.capture(self._anchor, self._scratch.add_, 1)

    def capture(self, graph: torch.cuda.CUDAGraph, fn, *args):
        """``fn(*args)`` captured into ``graph`` on this pool and stream; returns its outputs. Unlike
        ``torch.cuda.graph`` this neither synchronizes the device nor empties the allocator's cache."""
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.mempool.id, capture_error_mode="thread_local")
            try:
                out = fn(*args)
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        return out


def _signature(args) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) for a in args)


@contextlib.contextmanager
def _fla_tensor_cache_bypassed():
    """FLA memoizes small index tensors by argument identity (``fla.utils.tensor_cache``). One computed
    inside a capture would live in the graph's pool, written only by replays, and an eager call that
    hit it later could read another graph's data: during a capture the memo is bypassed."""
    import fla.utils

    before = getattr(fla.utils, "FLA_DISABLE_TENSOR_CACHE", False)
    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = before


class _GraphedCall:
    """``fn(*tensors)``: eager on the first call of a signature, captured on the second, replayed after.

    Falls back to eager for good (with one warning) if a capture fails.
    """

    def __init__(self, fn, graphs: RoundGraphs, name: str):
        self.fn, self.graphs, self.name = fn, graphs, name
        self.signature, self.calls = None, 0
        self.graph = self.inputs = self.outputs = None
        self.failed = False
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def __call__(self, *args):
        sig = _signature(args)
        if sig != self.signature:  # a new signature starts over (not expected inside one plan)
            self.signature, self.calls, self.graph = sig, 0, None
        self.calls += 1
        if self.graph is None and (self.calls == 1 or self.failed or not self._capture(args)):
            self.counts["eager"] += 1
            return self.fn(*args)
        for dst, src in zip(self.inputs, args):
            dst.copy_(src)
        self.graph.replay()
        self.counts["replayed"] += 1
        return tuple(o.clone() for o in self.outputs)

    def _capture(self, args) -> bool:
        """Capture ``fn`` on static inputs into the microbatch's :class:`GraphPool`."""
        inputs = tuple(torch.empty_like(a) for a in args)
        try:
            pool = self.graphs.graph_pool(args[0].device)
            graph = torch.cuda.CUDAGraph()
            with _fla_tensor_cache_bypassed():
                outputs = pool.capture(graph, self.fn, *inputs)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager execution
            self.failed = True
            warnings.warn(f"harts.gdn_graphs: capturing FLA's {self.name} in a CUDA graph failed ({e!r}); "
                          "this microbatch runs it eagerly", RuntimeWarning, stacklevel=3)
            return False
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.counts["captured"] += 1
        return True


class RoundGraphs:
    """CUDA graphs of one microbatch's FLA round calls (forward and backward), shared by its GDN layers.

    Create one per plan (``make_gdn_tree_params`` does when ``GdnTreeConfig.cuda_graphs``) and drop it
    with the microbatch: it keeps the graphs, their memory pool and the plan alive.
    """

    def __init__(self, plan, *, pool: GraphPool | None = None):
        self.plan = plan
        self.pool = pool
        """Memory of the captures (set before the first capture; ``None``: a new one then)."""
        self._calls: dict[tuple, _GraphedCall] = {}

    def graph_pool(self, device: torch.device) -> GraphPool:
        """``pool``, created on ``device`` at the first capture if none was given."""
        if self.pool is None:
            self.pool = GraphPool(device)
        return self.pool

    def _call(self, index: int, direction: str, scale: float, chunk_size: int) -> _GraphedCall:
        key = (index, direction, scale, chunk_size)
        if key not in self._calls:
            rd = self.plan.rounds[index]
            fn = functools.partial(_fla_fwd if direction == "forward" else _fla_bwd, cu=rd.cu_seqlens,
                                   chunk_indices=rd.chunk_indices, scale=scale, chunk_size=chunk_size)
            self._calls[key] = _GraphedCall(fn, self, f"round {index} {direction}")
        return self._calls[key]

    @property
    def counts(self) -> dict[str, int]:
        """Calls run ``eager``, ``captured`` and ``replayed`` (a captured call is then replayed too)."""
        out = {"eager": 0, "captured": 0, "replayed": 0}
        for c in self._calls.values():
            for k, v in c.counts.items():
                out[k] += v
        return out


class _FlaRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, graphs, index, scale, chunk_size):
        o, ht, gc, a = graphs._call(index, "forward", scale, chunk_size)(q, k, v, g, beta, h0)
        ctx.save_for_backward(q, k, v, gc, beta, a, h0)
        ctx.graphs, ctx.key, ctx.g_dtype = graphs, (index, "backward", scale, chunk_size), g.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, beta, a, h0 = ctx.saved_tensors
        call = ctx.graphs._call(*ctx.key)
        dq, dk, dv, dg, db, dh0 = call(q, k, v, gc, beta, a, h0, do.contiguous(), dht.contiguous())
        return dq, dk, dv, dg.to(ctx.g_dtype), db, dh0, None, None, None, None


def fla_round(q, k, v, g, beta, h0, *, graphs: RoundGraphs, index: int, scale: float, chunk_size: int):
    """Round ``index`` of ``graphs.plan`` through FLA: ``q, k [1, n, H, K]``, ``v [1, n, HV, V]``,
    ``g, beta [1, n, HV]``, ``h0 [N, HV, K, V]`` fp32 → ``o [1, n, HV, V]``, ``h_T [N, HV, K, V]`` fp32
    (differentiable in every input), eager or replayed from the microbatch's graphs."""
    if not 0 <= index < len(graphs.plan.rounds):
        raise GdnConfigError(f"round index {index} is outside the plan's {len(graphs.plan.rounds)} rounds")
    args = [x.contiguous() for x in (q, k, v, g, beta, h0)]
    return _FlaRound.apply(*args, graphs, index, scale, chunk_size)
