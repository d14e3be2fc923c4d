"""CUDA graphs of the GDN recurrence that the GDN layers of one microbatch share.

Every Gated DeltaNet layer of a microbatch runs the rounds of one :class:`harts.gdn.GdnPlan`: the same
gathers, ``cu_seqlens``, chunk indices and shapes, only ``q, k, v, g, β`` differ. On an H200 host the
recurrence's host side (the gathers and state hand-offs, FLA's Python, autotuner lookups and Triton's
launcher for the 5 forward / 8 backward kernels of every round) costs more than the GPU spends on a
16k-token tree (docs/harts_gdn.md). :class:`RoundGraphs` runs the first call of each direction
(:func:`harts.gdn_rounds.tree_recurrence`'s forward and backward over all rounds) eagerly, which
compiles and autotunes whatever is new, captures the second in a CUDA graph and replays it for every
later layer: the host then issues the copies into the graph's static inputs, one graph launch and,
for the forward, the copies of what the layer keeps (its output, start states and the kernels' saved
tensors). A replay runs the captured kernels with the configurations of the eager call: results are
bitwise those of eager execution (GPU test).

Memory: the graphs of a microbatch share one ``torch.cuda.MemPool`` that holds their
intermediates (gathered rows, chunk states ``h``, ``v_new``, ``dh``, …) and outputs, plus static
copies of one call's inputs per graph, until the :class:`RoundGraphs` is dropped with the
microbatch's parameters. A pool that outlives the microbatch (``TreeGatedDeltaNet`` passes the one
its layer keeps) hands those blocks to the next microbatch's captures: without it every microbatch
allocates its graphs' memory with ``cudaMalloc`` afresh (measured 31 calls, 5.6 ms of host time
per step at Qwen3-Next widths) and frees it with ``cudaFree``, which waits for the device.

A pool is a :class:`GraphPool`: one capture stream, so the blocks of the previous microbatch's graphs
are reused, and an anchor graph, without which torch 2.11's pinned-host allocator fails an internal
assert on the first capture into a pool whose graphs have all been dropped (GPU test).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

__all__ = ["GraphPool", "RoundGraphs"]


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

    Falls back to eager for good (with one warning) if a capture fails. ``keep_outputs``: a replay
    returns copies of the graph's outputs (they must outlive the next replay); else the graph's own
    output tensors, which the next replay overwrites.

    It refers to its :class:`RoundGraphs` weakly: a reference cycle would leave a dropped microbatch's
    graphs and pool to Python's cyclic collector, which can run in the middle of a later capture, and
    destroying a graph or releasing a pool's memory (``cudaFree``) inside a capture invalidates it.
    """

    def __init__(self, fn, graphs: RoundGraphs | None, name: str, *, keep_outputs: bool = True):
        self.fn, self.name, self.keep_outputs = fn, name, keep_outputs
        self._graphs = weakref.ref(graphs) if graphs is not None else lambda: None
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
        return tuple(o.clone() for o in self.outputs) if self.keep_outputs else tuple(self.outputs)

    def _capture(self, args) -> bool:
        """Capture ``fn`` on static inputs into the microbatch's :class:`GraphPool`."""
        inputs = tuple(torch.empty_like(a) for a in args)
        try:
            pool = self._graphs().graph_pool(args[0].device)
            graph = torch.cuda.CUDAGraph()
            with _fla_tensor_cache_bypassed():
                outputs = pool.capture(graph, self.fn, *inputs)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager execution
            self.failed = True
            warnings.warn(f"harts.gdn_graphs: capturing the {self.name} in a CUDA graph failed ({e!r}); "
                          "this microbatch runs it eagerly", RuntimeWarning, stacklevel=3)
            return False
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.counts["captured"] += 1
        return True


class RoundGraphs:
    """CUDA graphs of one microbatch's recurrence (forward and backward over all rounds), shared by its
    GDN layers.

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

    def call(self, key: tuple, fn, *, keep_outputs: bool = True) -> _GraphedCall:
        """The graphed call for ``key`` (``(direction, …)``), built around ``fn`` at its first request."""
        if key not in self._calls:
            self._calls[key] = _GraphedCall(fn, self, f"recurrence {key[0]}", keep_outputs=keep_outputs)
        return self._calls[key]

    @property
    def counts(self) -> dict[str, int]:
        """Calls run ``eager``, ``captured`` and ``replayed`` (a captured call is then replayed too)."""
        out = {"eager": 0, "captured": 0, "replayed": 0}
        for c in self._calls.values():
            for k, v in c.counts.items():
                out[k] += v
        return out
