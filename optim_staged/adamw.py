"""``StagedAdamW``: AdamW whose fp32 master, exp_avg and exp_avg_sq live in host slabs.

Two lanes update the staged elements, at the same time:

* **Slot lane.** Contiguous slab ranges ("units", at most ``slot_numel`` elements, which may split
  parameters) stream through the GPU slot ring: H2D of the state -> one PyTorch AdamW kernel call
  over the unit's pieces -> D2H. fp32 gradients are read in place; others are cast into one fp32
  scratch buffer. With fp32 parameters the parameter *is* the master weight (as in
  ``torch.optim.AdamW``), so only the moments travel: 8 B/param each way instead of 12.
* **Host lane** (``host_fraction`` > 0). The trailing units (whose gradients a backward pass
  produces first) are updated on the CPU by PyTorch's fused CPU AdamW, in place on the host
  slabs: gradient D2H (4 B/param), update, weights H2D (4 B/param). It runs on a worker thread
  while the slot lane streams; ``auto_balance`` searches the split on the measured step time.

``offload_gradients`` runs the update *during the backward pass*, from post-accumulate-grad hooks,
and frees every device gradient there (the memory of torchao's
``CPUOffloadOptimizer(offload_gradients=True)``, without sending the slot lane's gradients to the
host and back): a host-lane gradient goes D2H and the host lane (started at the first hook)
updates it as soon as it lands; a slot-lane gradient is consumed on the device by its units as
soon as every parameter of a unit has its gradient, then freed. The hook blocks while the
gradients still in flight, the slots and the next gradient would exceed ``offload_budget_bytes``
(default: the largest gradient, which autograd holds anyway), which paces the backward pass to
the slot lane when the backward pass is the faster of the two. ``step()`` finishes the lanes. Like torchao's mode, this excludes
gradient accumulation and clipping (gradients are gone when ``step()`` runs), and hyper-parameters
are read when the backward pass starts.

Moments may be stored in bf16 (``exp_avg_dtype`` / ``exp_avg_sq_dtype``); the update still runs in
fp32 on upcast copies and rounds the moments back to bf16 (round-to-nearest-even).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from optim_staged.base import StagedOptimizerBase, grad_of
from optim_staged.config import AdamWConfig, SlotConfig, StagedConfigError
from optim_staged.flat import read_flat_range, write_flat_range
from optim_staged.slabs import Piece, StateSlabs, Unit, build_units
from optim_staged.update import adamw_update_, choose_adamw_impl

__all__ = ["StagedAdamW", "host_lane_threads", "merge_units"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _dtype_name(field: str, value: Any) -> str:
    if isinstance(value, torch.dtype):
        if value not in _NAMES:
            raise StagedConfigError(f"{field}={value!r} is invalid: one of torch.float32|torch.bfloat16")
        return _NAMES[value]
    return value


def host_lane_threads(intra_op_threads: int, host_threads: int | None) -> int:
    """OpenMP threads of the host lane's worker: ``host_threads``, or half of PyTorch's intra-op
    count, which leaves the DMA engines host DRAM bandwidth (docs/optim_staged.md, split probe)."""
    return host_threads or max(1, intra_op_threads // 2)


def merge_units(units: list[Unit], max_numel: int) -> list[Unit]:
    """Merge consecutive units of one group into batches of at most ``max_numel`` elements (a unit
    larger than that stays alone); pieces of one parameter that meet at a unit border are joined."""
    out: list[Unit] = []
    cur: Unit | None = None
    for u in units:
        if cur is not None and cur.group == u.group and cur.end == u.start and cur.numel + u.numel <= max_numel:
            pieces = list(cur.pieces)
            for pc in u.pieces:
                last = pieces[-1] if pieces else None
                if (last is not None and last.param_index == pc.param_index
                        and last.p_start + last.numel == pc.p_start):
                    pieces[-1] = Piece(last.param_index, last.p_start, last.numel + pc.numel, last.unit_offset)
                else:
                    pieces.append(Piece(pc.param_index, pc.p_start, pc.numel, pc.unit_offset + cur.numel))
            cur = Unit(cur.group, cur.start, u.end, tuple(pieces))
        else:
            if cur is not None:
                out.append(cur)
            cur = u
    if cur is not None:
        out.append(cur)
    return out


class StagedAdamW(StagedOptimizerBase):
    """AdamW (decoupled weight decay, no AMSGrad) with host-staged state.

    Args:
        params: parameters or param-group dicts (any float dtype; CUDA or CPU).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; per-group values may change
            between steps.
        slots: slot size/count and pinning (:class:`~optim_staged.config.SlotConfig`).
        staged_fraction: fraction of elements (parameter order) whose state is staged; the rest
            stays on the parameters' device.
        impl: ``auto`` | ``fused`` | ``foreach`` update kernel (both lanes); ``auto`` chooses per
            unit by its number of slices (:func:`~optim_staged.update.choose_adamw_impl`).
        fused_max_slices: with ``auto``, most slices per unit for the fused kernel (None: the
            measured default of the device).
        host_fraction: share of the staged elements updated on the host CPU (trailing units).
            0 (default): every update runs in the GPU slots, bitwise equal to
            ``torch.optim.AdamW(fused=True)``.
        auto_balance: search the split on the measured step time over the first
            ``balance_steps`` steps, starting from ``host_fraction``, then keep the best.
        offload_gradients: update during the backward pass from gradient hooks and free the
            device gradients there (standalone use, leaf parameters; no gradient accumulation: a
            second gradient for a parameter before ``step()`` raises; no clipping).
        offload_budget_bytes: bound on slot-lane gradients in flight + slots + the next gradient
            with ``offload_gradients`` (None: the largest staged gradient).
        host_batch_numel: elements per host-lane kernel call (it uses PyTorch's intra-op threads,
            ``torch.set_num_threads``).
        offload_prefetch: with ``offload_gradients``, each hook starts the H2D of the slot units of
            the parameter expected next (the previous step's arrival order).
        host_threads: intra-op threads of the host lane's worker (None: half of PyTorch's
            intra-op count). The host AdamW and the DMA engines share host DRAM bandwidth: a
            lane on every core slows the link most (measured on the H200 box, docs/optim_staged.md).
        exp_avg_dtype, exp_avg_sq_dtype: moment storage, ``fp32`` | ``bf16`` (or the torch dtypes).

    ``state[p]`` holds ``master_param``, ``exp_avg``, ``exp_avg_sq`` (views of the host slabs,
    current after ``drain()``). With fp32 parameters the parameter is the master weight: writes
    through ``set_scaled_state``/``load_state_dict`` update the parameter too.
    """

    state_keys = ("master_param", "exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, slots: SlotConfig | None = None,
                 staged_fraction: float = 1.0, impl: str = "auto",
                 device: torch.device | str | None = None, host_fraction: float = 0.0,
                 auto_balance: bool = False, balance_steps: int = 8, offload_gradients: bool = False,
                 host_batch_numel: int = 16 << 20, offload_budget_bytes: int | None = None,
                 exp_avg_dtype: str | torch.dtype = "fp32", exp_avg_sq_dtype: str | torch.dtype = "fp32",
                 fused_max_slices: int | None = None, host_threads: int | None = None,
                 offload_prefetch: bool = True) -> None:
        m_name = _dtype_name("exp_avg_dtype", exp_avg_dtype)
        v_name = _dtype_name("exp_avg_sq_dtype", exp_avg_sq_dtype)
        AdamWConfig(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, impl=impl,  # validates
                    host_fraction=host_fraction, auto_balance=auto_balance, balance_steps=balance_steps,
                    exp_avg_dtype=m_name, exp_avg_sq_dtype=v_name, fused_max_slices=fused_max_slices)
        if host_batch_numel < 1024:
            raise StagedConfigError(f"host_batch_numel={host_batch_numel!r} is invalid: must be >= 1024 elements")
        if host_threads is not None and (not isinstance(host_threads, int) or host_threads < 1):
            raise StagedConfigError(f"host_threads={host_threads!r} is invalid: must be None or an int >= 1")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.impl = impl
        self.fused_max_slices = fused_max_slices
        self.host_fraction = float(host_fraction)
        self.auto_balance = bool(auto_balance)
        self.balance_steps = int(balance_steps)
        self.offload_gradients = bool(offload_gradients)
        self.host_batch_numel = int(host_batch_numel)
        self.host_threads = host_threads
        self.offload_prefetch = bool(offload_prefetch)
        self.offload_budget_bytes = offload_budget_bytes
        self.moment_dtypes = {"exp_avg": _DTYPES[m_name], "exp_avg_sq": _DTYPES[v_name]}
        self._step_tensors: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._grads: StateSlabs | None = None  # host gradient slab (host lane, offloaded gradients)
        self._hooks: list[Any] = []
        self._arrived: list[bool] = []  # offload: gradient of parameter i arrived in this backward pass
        self._begun = False  # offload: this step's update started in the backward pass
        self._bwd = threading.Condition()  # host lane waits here for gradients (hooks notify)
        self._bwd_done = False
        self._held: dict[int, torch.Tensor] = {}  # slot-lane device gradients not yet consumed
        self._held_left: dict[int, int] = {}
        self._pending: collections.deque = collections.deque()  # (compute event, bytes) of freed grads
        self._pending_bytes = 0
        self._next_after: dict[int, int] = {}  # arrival order of the previous step: i -> next i
        self._order: list[int] = []
        self._future = None
        self._param_is_master = False
        self._masters_stale = False  # slot lane updated fp32 params: host masters lag behind
        self._host_units: list[Unit] = []
        self._host_batches: list[Unit] = []
        self._all_units: list[Unit] = []
        self._host_share: float | None = None  # current host share of staged elements
        self._balanced, self._tried, self._delta = 0, {}, 0.1  # auto_balance search state
        self._timing: tuple[int, int, Any, Any] | None = None
        self._upload_buf: torch.Tensor | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._cuda: dict[str, Any] | None = None  # streams and events of the host lane
        self._tmp: dict[str, torch.Tensor] = {}
        super().__init__(params, defaults, slots=slots, staged_fraction=staged_fraction, device=device)
        if self.offload_gradients:
            self._ensure_layout()  # slabs and gradient hooks before the first backward pass

    @classmethod
    def from_config(cls, params: Iterable[Any], cfg: AdamWConfig, *, slots: SlotConfig | None = None,
                    staged_fraction: float = 1.0, **kwargs: Any) -> StagedAdamW:
        return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                   slots=slots, staged_fraction=staged_fraction, impl=cfg.impl, host_fraction=cfg.host_fraction,
                   auto_balance=cfg.auto_balance, balance_steps=cfg.balance_steps,
                   exp_avg_dtype=cfg.exp_avg_dtype, exp_avg_sq_dtype=cfg.exp_avg_sq_dtype,
                   fused_max_slices=cfg.fused_max_slices, **kwargs)

    # ------------------------------------------------------------------ layout
    def _state_dtypes(self) -> dict[str, torch.dtype]:
        return {"master_param": torch.float32, **self.moment_dtypes}

    def _ring_spec(self) -> dict[str, Any]:
        self._param_is_master = bool(self._staged_idx) and all(  # a flat view of the param is the master
            self._plist[i][1].dtype == torch.float32 and self._plist[i][1].is_contiguous() for i in self._staged_idx)
        keys = _MOMENTS if self._param_is_master else self.state_keys
        return {"keys": keys, "dtypes": self._state_dtypes(),
                "keep_resident": self.slot_config.keep_resident and not self.offload_gradients}

    def _units(self, entries, *, whole: bool = False) -> list[Unit]:
        if not entries:
            return []
        if whole:
            return [Unit(g, o, o + p.numel(), (Piece(i, 0, p.numel(), 0),)) for i, g, p, o in entries if p.numel()]
        units = build_units([p.numel() for _, _, p, _ in entries], [o for *_, o in entries],
                            [g for _, g, _, _ in entries], slot_numel=self.slot_config.slot_numel,
                            whole_params=self.offload_gradients)
        # build_units indexes entries positionally; map back to parameter indices.
        idx = [i for i, *_ in entries]
        return [Unit(u.group, u.start, u.end,
                     tuple(Piece(idx[pc.param_index], pc.p_start, pc.numel, pc.unit_offset) for pc in u.pieces))
                for u in units]

    def _build_ring(self) -> None:
        super()._build_ring()
        self._all_units = list(self._staged_units)
        self._masters_stale = False
        if self._host_share is None or not self.auto_balance:
            self._host_share = self.host_fraction
        self._set_split(self._split_index(self._host_share))

    def _split_index(self, host_share: float) -> int:
        """Index of the first host-lane unit: the host lane gets about ``host_share`` of the
        staged elements, taken from the end."""
        units = self._all_units
        if not units:
            return 0
        total = units[-1].end - units[0].start
        target = (1.0 - host_share) * total
        k = min(range(len(units) + 1), key=lambda j: abs((units[j].start if j < len(units) else units[-1].end)
                                                         - units[0].start - target))
        if host_share > 0.0 and k == len(units):
            k = len(units) - 1
        return k

    def _set_split(self, k: int) -> None:
        self._staged_units = self._all_units[:k]  # the slot lane (base class: prefetch, residency)
        self._host_units = self._all_units[k:]
        self._host_batches = merge_units(self._host_units, self.host_batch_numel)
        # offload bookkeeping: which slot units each parameter feeds, and its host-lane range
        self._unit_params = [tuple(sorted({pc.param_index for pc in u.pieces})) for u in self._staged_units]
        self._param_units: dict[int, list[int]] = {}
        for k_, ps in enumerate(self._unit_params):
            for i in ps:
                self._param_units.setdefault(i, []).append(k_)
        self._param_host: dict[int, tuple[int, int, int]] = {}  # i -> (p_start, numel, slab offset)
        for u in self._host_units:
            for pc in u.pieces:
                a, n, o = self._param_host.get(pc.param_index, (pc.p_start, 0, u.start + pc.unit_offset))
                self._param_host[pc.param_index] = (a, n + pc.numel, o)
        self._reset_backward()

    def _reset_backward(self) -> None:
        self._missing = [len(ps) for ps in self._unit_params]
        self._unit_done = [False] * len(self._unit_params)
        self._arrived = [False] * len(getattr(self, "_plist", []))
        self._held.clear()
        self._held_left.clear()
        self._begun = self._bwd_done = False

    def _ensure_layout(self) -> None:
        before = self._layout_key
        super()._ensure_layout()
        if self._layout_key != before:
            self._after_layout()

    def _after_layout(self, keep_grads: StateSlabs | None = None) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        plist = self._plist
        self._params_list = [p for _, p in plist]
        self._reset_backward()
        self._staged_ids = {id(plist[i][1]) for i in self._staged_idx}
        need = self.offload_gradients or self.host_fraction > 0 or self.auto_balance
        cfg = self.slot_config
        cuda = self._dev.type == "cuda"
        if keep_grads is not None and keep_grads.numel == self.slabs.numel:
            self._grads = keep_grads
        else:
            self._grads = (StateSlabs(("grad",), self.slabs.numel, pin=cfg.pin_memory and cuda,
                                      memory_margin=cfg.host_memory_margin, huge_pages=cfg.huge_pages)
                           if need else None)
        if cuda and self._cuda is None:
            self._cuda = {"grad": torch.cuda.Stream(self._dev), "upload": torch.cuda.Stream(self._dev),
                          "ready": torch.cuda.Event(enable_timing=True),
                          "host_end": torch.cuda.Event(enable_timing=True), "uploaded": False,
                          "threads": None}
        if cuda:
            self._cuda["param_events"] = [torch.cuda.Event() for _ in plist]
        if self.offload_gradients:
            for i in self._staged_idx:
                p = plist[i][1]
                if not (p.requires_grad and p.is_leaf):
                    raise StagedConfigError(
                        f"offload_gradients=True needs leaf parameters that require grad; parameter {i} of shape "
                        f"{tuple(p.shape)} is not one")
                self._hooks.append(p.register_post_accumulate_grad_hook(self._offload_hook))
            self._pindex = {id(p): i for i, (_, p) in enumerate(plist)}
            gb = [plist[i][1].numel() * plist[i][1].element_size() for i in self._staged_idx]
            self._budget = self.offload_budget_bytes if self.offload_budget_bytes is not None else max(gb, default=0)

    # ---------------------------------------------------------------- gradients
    def _offload_hook(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook (``offload_gradients``): start this step's update with the first
        gradient; send a host-lane gradient down, hand a slot-lane gradient to its units (streamed
        once all their parameters arrived); free the device gradient; keep the memory in budget."""
        g = p.grad
        if g is None:
            return
        i = self._pindex[id(p)]
        if self._arrived[i]:
            raise StagedConfigError(
                f"offload_gradients=True does not support gradient accumulation: parameter {i} of shape "
                f"{tuple(p.shape)} got a second gradient before step()")
        if not self._begun:
            self._start_in_backward()
        self._order.append(i)
        p.grad = None
        g = g.detach()
        cu = self._cuda
        host = self._param_host.get(i)
        if host is not None:
            a, n, o = host
            dst = self._grads["grad"][o:o + n]
            if cu is not None:
                s = cu["grad"]
                s.wait_stream(torch.cuda.current_stream(self._dev))  # the backward wrote it there
                with torch.cuda.stream(s):
                    read_flat_range(g, a, dst, non_blocking=True)  # any strides
                    cu["param_events"][i].record(s)
                g.record_stream(s)
                if i not in self._param_units:  # freed once its D2H is done (else: after its units)
                    nb = g.numel() * g.element_size()
                    self._pending.append((cu["param_events"][i], nb))
                    self._pending_bytes += nb
            else:
                read_flat_range(g, a, dst)
        units = self._param_units.get(i)
        if units:
            self._held[i], self._held_left[i] = g, len(units)
            ready = []
            for k in units:
                self._missing[k] -= 1
                if self._missing[k] == 0:
                    ready.append(k)
            if ready:
                self._stream_units(ready)
        # Arrived only now that its D2H is queued and its event recorded: the host lane reads the
        # host slab after that event, never after an older one.
        with self._bwd:
            self._arrived[i] = True
            self._bwd.notify_all()
        g = None  # freed here unless a unit still holds it: slots never join this gradient's peak
        self._prefetch_next(i)
        if cu is not None:
            self._throttle(i)

    def _start_in_backward(self) -> None:
        """First gradient of a step (``offload_gradients``): balance, advance the step counters,
        start the host lane, mark the time origin."""
        self._wait_fences()
        self._maybe_rebalance()
        self._begin_step()
        self._begun, self._bwd_done, self._ring_begun = True, False, False
        self._order = []
        cu = self._cuda
        if cu is not None:
            cu["ready"].record(torch.cuda.current_stream(self._dev))
            batches = self._host_batches[::-1]
            if batches:
                # the host thread re-takes the GIL between kernels while the hooks run Python
                self._switch = sys.getswitchinterval()
                sys.setswitchinterval(min(self._switch, 2e-4))
                self._future = self._submit(batches, None)
        self._t_ring = 0.0

    def _stream_units(self, ks: list[int]) -> None:
        """Slot lane of the backward pass: stream units ``ks`` now (their gradients are on the
        device), then free each gradient whose units are all enqueued."""
        ring = self._ring
        units = [self._staged_units[k] for k in ks]
        params = self._params_list
        t0 = time.perf_counter()
        ring.run(units, self.slabs, lambda u, v, ph: self._compute(u, v, params, ph), join_caller=False,
                 after_write_backs=not self._ring_begun)
        self._t_ring += time.perf_counter() - t0
        self._ring_begun = True
        self._masters_stale |= self._param_is_master
        ev = None
        for k in ks:
            self._unit_done[k] = True
            for j in self._unit_params[k]:
                if j not in self._held:
                    continue
                self._held_left[j] -= 1
                if self._held_left[j] == 0:
                    g = self._held.pop(j)
                    if ring.cuda:
                        if ev is None:
                            ev = torch.cuda.Event()
                            ev.record(ring.compute_stream)
                        g.record_stream(ring.compute_stream)  # freed for reuse after the compute
                        nb = g.numel() * g.element_size()
                        self._pending.append((ev, nb))
                        self._pending_bytes += nb

    def _prefetch_next(self, i: int) -> None:
        """Start the H2D of the slot units of the parameter expected next (arrival order of the
        previous step), so the copy engine stays busy while this hook waits in :meth:`_throttle`
        and autograd computes that gradient. A wrong guess costs only bandwidth: the slots hold
        clean copies of host ranges not yet updated in this step."""
        if not self.offload_prefetch:
            return
        ring = self._ring
        j, seen = self._next_after.get(i), 0
        while (j is not None and seen < len(self._arrived)
               and (self._arrived[j] or j not in self._param_units)):
            if not ring.slots and not self._arrived[j]:
                return  # a host-lane gradient comes first: no slots under its peak (offload_plan)
            j, seen = self._next_after.get(j), seen + 1
        if j is None or self._arrived[j]:
            return
        ks = [k for k in self._param_units[j] if not self._unit_done[k]][:ring.num_slots]
        if ks:
            ring.prefetch([self._staged_units[k] for k in ks], self.slabs,
                          after_write_backs=not self._ring_begun)
            self._ring_begun = True

    def _throttle(self, i: int) -> None:
        """Block until the gradients still in flight (freed, but read by a D2H copy or a slot
        compute, so their memory is not reusable yet) + the ones held for a unit + the slots + the
        next gradient fit the budget."""
        nxt = self._next_after.get(i)
        if nxt is None or self._arrived[nxt]:
            left = [self._plist[j][1] for j in self._staged_idx if not self._arrived[j]]
            nxt_b = max((q.numel() * q.element_size() for q in left), default=0)
        else:
            q = self._plist[nxt][1]
            nxt_b = q.numel() * q.element_size()
        held = sum(g.numel() * g.element_size() for g in self._held.values())
        ring = self._ring
        slots = ring.num_slots * ring.slot_numel * sum(
            torch.empty((), dtype=ring.dtypes[k]).element_size() for k in ring.keys) if self._staged_units else 0
        while self._pending and self._pending_bytes + held + slots + nxt_b > self._budget:
            ev, nb = self._pending.popleft()
            ev.synchronize()
            self._pending_bytes -= nb

    def _finish_in_backward(self, params: list[torch.Tensor]) -> None:
        """``step()`` with ``offload_gradients``: stream the slot units whose parameters did not all
        get a gradient, finish the host lane, join the streams, give the slots back."""
        cu, ring = self._cuda, self._ring
        with self._bwd:
            self._bwd_done = True
            self._bwd.notify_all()
        left = [k for k, done in enumerate(self._unit_done)
                if not done and any(self._arrived[j] for j in self._unit_params[k])]
        if left:
            self._stream_units(left)
        t_host = 0.0
        if self._future is not None:
            f, self._future = self._future, None
            try:
                f.result()
            finally:
                sys.setswitchinterval(self._switch)
        elif self._host_batches:
            t1 = time.perf_counter()
            self._host_lane(self._host_batches[::-1], params, None)
            t_host = time.perf_counter() - t1
        if cu is not None:
            caller = torch.cuda.current_stream(self._dev)
            caller.wait_stream(ring.compute_stream)
            caller.wait_stream(cu["upload"])
            self._pending.clear()
            self._pending_bytes = 0
        ring.release()  # slots back to the allocator before the next backward pass (CPU: same path)
        self._next_after = dict(zip(self._order, self._order[1:]))
        self._record_timing("cuda" if cu is not None else t_host, self._t_ring)
        self._reset_backward()

    def _live(self, params: list[torch.Tensor], i: int) -> bool:
        return self._arrived[i] if self.offload_gradients else grad_of(params[i]) is not None

    def _device_grad(self, params: list[torch.Tensor], i: int) -> torch.Tensor | None:
        return self._held.get(i) if self.offload_gradients else grad_of(params[i])

    def _grads_down(self, batches: list[Unit], params: list[torch.Tensor]) -> list[Any]:
        """Host lane, gradients on the device: D2H of every batch's gradient pieces into the host
        slab, in processing order; returns one event per batch (None on CPU)."""
        grads = self._grads["grad"]
        events = []
        ctx = torch.cuda.stream(self._cuda["grad"]) if self._cuda is not None else contextlib.nullcontext()
        with ctx:
            if self._cuda is not None:
                self._cuda["grad"].wait_event(self._cuda["ready"])
            for b in batches:
                for pc in b.pieces:
                    g = grad_of(params[pc.param_index])
                    if g is None:
                        continue
                    s = b.start + pc.unit_offset
                    read_flat_range(g.detach(), pc.p_start, grads[s:s + pc.numel], non_blocking=True)
                if self._cuda is not None:
                    ev = torch.cuda.Event()
                    ev.record(self._cuda["grad"])
                    events.append(ev)
                else:
                    events.append(None)
        return events

    def _submit(self, batches: list[Unit], events: list[Any] | None):
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="optim_staged_host")
            weakref.finalize(self, self._executor.shutdown, wait=False)
        return self._executor.submit(self._host_lane, batches, self._params_list, events)

    # -------------------------------------------------------------------- step
    def _begin_step(self) -> None:
        if self._begun:
            return  # offload_gradients: advanced when the backward pass started
        super()._begin_step()
        devs = [self.compute_device]
        if self.compute_device.type != "cpu":
            # always, not only when this split has host batches: auto_balance may give the host lane
            # its first units after this point (in step(), from a split that had none)
            devs.append(torch.device("cpu"))
        # One step tensor per group and device, filled once on the host side of the step.
        for dev in devs:
            for gi, g in enumerate(self.param_groups):
                t = self._step_tensors.get((gi, dev))
                if t is None:
                    t = self._step_tensors[(gi, dev)] = torch.zeros((), dtype=torch.float32, device=dev)
                t.fill_(float(g["step"]))

    def prefetch(self) -> None:
        self._ensure_layout()
        if self._staged_units and not self.offload_gradients:
            self._ring.prefetch(self._staged_units, self.slabs, reverse=self._reverse_at(self._step_count() + 1))

    def _run_staged(self, params: list[torch.Tensor]) -> None:
        if self.offload_gradients:
            if self._begun:
                self._finish_in_backward(params)
            return  # no gradient arrived: nothing to update (the counters still advance)
        self._maybe_rebalance()
        ring, cu = self._ring, self._cuda
        cuda = ring.cuda
        batches = self._host_batches[::-1]  # trailing first: their gradients come first
        caller = torch.cuda.current_stream(self._dev) if cuda else None
        if cuda:
            cu["ready"].record(caller)  # (2) gradients and prior uses of the parameters are queued before it
        switch = sys.getswitchinterval()
        t0 = time.perf_counter()
        future = None
        if batches and cuda:
            cu["upload"].wait_event(cu["ready"])  # parameters are rewritten only after their uses
            events = self._grads_down(batches, params)
            sys.setswitchinterval(min(switch, 2e-4))  # the host thread re-takes the GIL between kernels
            future = self._submit(batches, events)
        t_host = 0.0
        try:
            if self._staged_units:
                ring.run(self._staged_units, self.slabs, lambda u, v, ph: self._compute(u, v, params, ph),
                         reverse=self._reverse_at(self._step_count()))
                self._masters_stale |= self._param_is_master
            t_ring = time.perf_counter() - t0
            if future is not None:
                future, f = None, future
                f.result()
                caller.wait_stream(cu["upload"])
            elif batches:
                t1 = time.perf_counter()
                self._host_lane(batches, params, self._grads_down(batches, params))
                t_host = time.perf_counter() - t1
        finally:
            if future is not None:  # the slot lane raised: let the host lane finish before leaving
                future.exception()
            sys.setswitchinterval(switch)
        self._record_timing("cuda" if cuda else t_host, t_ring)

    def _record_timing(self, t_host, t_ring) -> None:
        host_n = sum(u.numel for u in self._host_units)
        ring_n = sum(u.numel for u in self._staged_units)
        self._timing = (host_n, ring_n, t_host, None if t_host == "cuda" else t_ring)

    def _host_lane(self, batches: list[Unit], params: list[torch.Tensor], events: list[Any] | None) -> None:
        """Update ``batches`` on the CPU, in place on the host slabs, then send the weights up.
        ``events``: per-batch gradient-D2H events; None with ``offload_gradients`` (per-parameter
        events of the hooks; a batch waits until its parameters' gradients arrived or the backward
        pass ended)."""
        cu = self._cuda
        if cu is not None:
            if self._dev.index is not None:
                torch.cuda.set_device(self._dev.index)
            # By default half of PyTorch's intra-op threads (this worker thread only, as OpenMP
            # thread counts are per thread): the DMA engines keep host DRAM bandwidth, the thread
            # streaming the slot lane keeps a core, and no OpenMP team member is preempted.
            want = host_lane_threads(cu.setdefault("threads0", torch.get_num_threads()), self.host_threads)
            if cu["threads"] != want:
                torch.set_num_threads(want)
                cu["threads"] = want
            if cu["uploaded"]:
                cu["host_end"].synchronize()  # the last step's uploads have read the masters
        slabs, grads, cpu = self.slabs, self._grads["grad"], torch.device("cpu")
        narrow = any(d != torch.float32 for d in self.moment_dtypes.values())
        for bi, b in enumerate(batches):
            if self.offload_gradients and cu is not None:
                bparams = {pc.param_index for pc in b.pieces}
                with self._bwd:
                    self._bwd.wait_for(lambda bp=bparams: self._bwd_done or all(self._arrived[j] for j in bp))
            live = [pc for pc in b.pieces if self._live(params, pc.param_index)]
            if not live:
                continue
            if cu is not None:  # gradients on the host
                if events is not None:
                    events[bi].synchronize()
                else:
                    for i in {pc.param_index for pc in live}:
                        cu["param_events"][i].synchronize()
            sl = [slice(b.start + pc.unit_offset, b.start + pc.unit_offset + pc.numel) for pc in live]
            masters = [slabs["master_param"][s] for s in sl]
            gs = [grads[s] for s in sl]
            if narrow:
                m32, v32 = self._host_tmp(b.numel)
                m32[:b.numel].copy_(slabs["exp_avg"][b.start:b.end])
                v32[:b.numel].copy_(slabs["exp_avg_sq"][b.start:b.end])
                ms = [m32[pc.unit_offset:pc.unit_offset + pc.numel] for pc in live]
                vs = [v32[pc.unit_offset:pc.unit_offset + pc.numel] for pc in live]
            else:
                ms = [slabs["exp_avg"][s] for s in sl]
                vs = [slabs["exp_avg_sq"][s] for s in sl]
            g = self.param_groups[b.group]
            beta1, beta2 = g["betas"]
            if cu is not None:  # as PyTorch's CUDA kernel, which takes 1 - beta in fp32 (the CPU one in fp64)
                beta1, beta2 = (float(torch.tensor(x, dtype=torch.float32)) for x in (beta1, beta2))
            adamw_update_(masters, gs, ms, vs, step=self._step_tensors[(b.group, cpu)], lr=float(g["lr"]),
                          beta1=beta1, beta2=beta2, eps=g["eps"], weight_decay=g["weight_decay"],
                          impl=self._unit_impl(len(masters), masters[0]), step_value=g["step"])
            if narrow:
                slabs["exp_avg"][b.start:b.end].copy_(m32[:b.numel])
                slabs["exp_avg_sq"][b.start:b.end].copy_(v32[:b.numel])
            self._upload(b, live, params)
        if cu is not None:
            cu["host_end"].record(cu["upload"])
            cu["uploaded"] = True

    def _host_tmp(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._tmp.get("mv")
        if t is None or t.numel() < 2 * numel:
            t = self._tmp["mv"] = torch.empty(2 * max(numel, self.host_batch_numel), dtype=torch.float32)
        h = t.numel() // 2
        return t[:h], t[h:]

    def _upload(self, b: Unit, live: list[Piece], params: list[torch.Tensor]) -> None:
        """Parameters <- host masters of ``b``: straight into fp32 parameters, through one fp32
        device buffer (then cast on the device) otherwise."""
        master = self.slabs["master_param"]
        cu = self._cuda
        if cu is None:
            for pc in live:
                s = b.start + pc.unit_offset
                write_flat_range(params[pc.param_index].detach(), pc.p_start, master[s:s + pc.numel])
            return
        with torch.cuda.stream(cu["upload"]):
            if self.offload_gradients:  # the backward pass is done with these parameters
                for i in {pc.param_index for pc in live}:
                    cu["upload"].wait_event(cu["param_events"][i])
            if self._param_is_master:
                for pc in live:
                    s = b.start + pc.unit_offset
                    dst = params[pc.param_index].detach().view(-1)[pc.p_start:pc.p_start + pc.numel]
                    dst.copy_(master[s:s + pc.numel], non_blocking=True)
                return
            if self._upload_buf is None or self._upload_buf.numel() < b.numel:
                # allocated on the upload stream, its only user: reuse is ordered by that stream
                self._upload_buf = torch.empty(max(b.numel, self.host_batch_numel), dtype=torch.float32,
                                               device=self._dev)
            buf = self._upload_buf
            buf[:b.numel].copy_(master[b.start:b.end], non_blocking=True)
            for pc in live:
                write_flat_range(params[pc.param_index].detach(), pc.p_start, buf[pc.unit_offset:pc.unit_offset + pc.numel])

    def _compute(self, unit: Unit, views: dict[str, torch.Tensor], params: list[torch.Tensor], phases) -> None:
        g = self.param_groups[unit.group]
        ring_lane = phases is not None
        param_master = ring_lane and self._param_is_master
        narrow = views["exp_avg"].dtype != torch.float32 or views["exp_avg_sq"].dtype != torch.float32
        n = unit.numel
        scratch = self._scratch(3 * n) if narrow else None
        masters, grads, ms, vs, live = [], [], [], [], []
        for pc in unit.pieces:
            p = params[pc.param_index]
            sl = slice(pc.unit_offset, pc.unit_offset + pc.numel)
            grad = self._device_grad(params, pc.param_index) if ring_lane else grad_of(p)
            if grad is None:
                continue
            piece = grad.reshape(-1)[pc.p_start:pc.p_start + pc.numel] if grad.is_contiguous() else None
            if piece is None or piece.dtype != torch.float32:  # e.g. bf16 grads: fp32 copy on the device
                if scratch is None:
                    scratch = self._scratch(n)
                read_flat_range(grad, pc.p_start, scratch[sl], non_blocking=True)  # any strides
                piece = scratch[sl]
            if param_master:
                masters.append(p.detach().view(-1)[pc.p_start:pc.p_start + pc.numel])
            else:
                masters.append(views["master_param"][sl])
            grads.append(piece)
            live.append(pc)
        if not live:
            return
        if narrow:  # fp32 working copies of the moments (after the grad scratch at [0, n))
            m32, v32 = scratch[n:2 * n], scratch[2 * n:3 * n]
            m32.copy_(views["exp_avg"])
            v32.copy_(views["exp_avg_sq"])
            src_m, src_v = m32, v32
        else:
            src_m, src_v = views["exp_avg"], views["exp_avg_sq"]
        for pc in live:
            sl = slice(pc.unit_offset, pc.unit_offset + pc.numel)
            ms.append(src_m[sl])
            vs.append(src_v[sl])
        beta1, beta2 = g["betas"]
        adamw_update_(masters, grads, ms, vs, step=self._step_tensors[(unit.group, self.compute_device)],
                      lr=float(g["lr"]), beta1=beta1, beta2=beta2, eps=g["eps"],
                      weight_decay=g["weight_decay"], impl=self._unit_impl(len(live), masters[0]),
                      step_value=g["step"])
        if narrow:
            views["exp_avg"].copy_(m32)
            views["exp_avg_sq"].copy_(v32)
        if not param_master:
            for pc, m in zip(live, masters):
                write_flat_range(params[pc.param_index].detach(), pc.p_start, m)  # view(-1) when contiguous

    def _unit_impl(self, num_slices: int, sample: torch.Tensor) -> str:
        """The AdamW kernel for one unit: ``impl``, or with ``auto`` the per-unit choice by slice count."""
        if self.impl != "auto":
            return self.impl
        return choose_adamw_impl(num_slices, sample, self.fused_max_slices)

    # ----------------------------------------------------------------- balance
    def _maybe_rebalance(self) -> None:
        """``auto_balance``: a pattern search over the host share on the measured step time (the
        later of the two lanes' ends, from the step's start). It does not assume the lanes are
        independent: on a machine where the host update and the DMA engines share DRAM bandwidth,
        moving work to the host can slow the slot lane down (measured on the H200 box), which a
        rate-equalizing rule cannot see. Tries share +/- delta around the best so far, halves
        delta when neither is better, and keeps the best after ``balance_steps`` measurements."""
        if not self.auto_balance or self._balanced >= self.balance_steps or self._timing is None:
            return
        host_n, ring_n, t_host, t_ring = self._timing
        if t_host == "cuda":
            cu, ring = self._cuda, self._ring
            ends = ([*ring.end_events] if ring_n else []) + ([cu["host_end"]] if host_n else [])
            if not all(e.query() for e in ends):
                return  # previous step still running: measure later
            t = max([cu["ready"].elapsed_time(e) for e in ends] or [0.0])
        else:
            t = t_host + t_ring  # CPU: the lanes run one after the other
        self._timing = None
        total = max(1, host_n + ring_n)
        share = round(host_n / total, 6)
        tried = self._tried
        tried[share] = min(t, tried.get(share, float("inf")))
        self._balanced += 1
        best = min(tried, key=tried.get)
        if self._balanced >= self.balance_steps:
            nxt = best
        else:
            nxt = None
            while nxt is None and self._delta >= 0.01:
                for c in (best + self._delta, best - self._delta):
                    c = min(max(c, 0.0), 0.95)
                    if all(abs(c - x) > 0.5 * self._delta for x in tried):
                        nxt = c
                        break
                else:
                    self._delta /= 2
            if nxt is None:
                nxt, self._balanced = best, self.balance_steps
        self._host_share = nxt
        k = self._split_index(nxt)
        if k != len(self._staged_units):
            self.drain(release=False)  # slot cache and stale masters settled before units change lanes
            self._ring.forget()
            self._set_split(k)

    def rebalance(self) -> None:
        """Restart ``auto_balance`` (e.g. after the machine's load changed)."""
        self._balanced, self._tried, self._delta = 0, {}, 0.1

    def set_split(self, host_fraction: float | None = None, *, auto_balance: bool | None = None,
                  offload_gradients: bool | None = None) -> None:
        """Change the lane split, auto-balancing or gradient offload between steps (no gradient
        may be pending). Writes back and frees the slots; keeps the host slabs."""
        if self._begun:
            raise StagedConfigError("set_split() between a backward pass and its step(): call step() first")
        hf = self.host_fraction if host_fraction is None else float(host_fraction)
        ab = self.auto_balance if auto_balance is None else bool(auto_balance)
        AdamWConfig(host_fraction=hf, auto_balance=ab, balance_steps=self.balance_steps)  # validates
        self._wait_fences()
        self._ensure_layout()
        self.drain(release=True)
        self.host_fraction, self.auto_balance = hf, ab
        if offload_gradients is not None:
            self.offload_gradients = bool(offload_gradients)
        self._host_share, self._timing = None, None
        self.rebalance()
        self._build_ring()
        grads = self._grads
        self._after_layout(keep_grads=grads)

    def offload_plan(self, *, num_slots: int | None = None, min_slot_numel: int = 1 << 20,
                     bound_bytes: int | None = None, margin_bytes: int = 1 << 20) -> tuple[float, SlotConfig]:
        """Host share and slots for ``offload_gradients`` whose *allocated* peak stays within
        ``bound_bytes`` (default: the largest staged gradient, which autograd allocates anyway, and
        the peak of torchao's ``offload_gradients=True``).

        A host-lane gradient is freed in its hook once its D2H is queued, so it adds nothing to the
        allocated peak; a slot-lane gradient of ``b`` bytes is live together with the slots, so
        ``b + num_slots * slot_numel * (slot bytes per element) <= bound_bytes - margin_bytes``
        must hold for every slot-lane parameter (slots are allocated only once a slot-lane gradient
        is next, so host-lane gradients that arrive before it never share their peak with them). The
        host lane takes the shortest suffix of the staged parameters (slab order; in a backward
        pass its gradients arrive first) that leaves slots of at least
        ``min_slot_numel`` elements; ``slot_numel`` is the largest that fits (a multiple of 64 Ki,
        at most the current one). Apply with ``set_slot_config`` then ``set_split``."""
        self._ensure_layout()
        ns = self.slot_config.num_slots if num_slots is None else int(num_slots)
        ring = self._ring
        per = sum(torch.empty((), dtype=ring.dtypes[k]).element_size() for k in ring.keys)
        sizes = [(self._plist[i][1].numel(), self._plist[i][1].numel() * self._plist[i][1].element_size())
                 for i in self._staged_idx]
        if not sizes:
            return 0.0, self.slot_config
        bound = max(b for _, b in sizes) if bound_bytes is None else int(bound_bytes)
        total = sum(n for n, _ in sizes)
        prefix_max = [0]
        for _, b in sizes:
            prefix_max.append(max(prefix_max[-1], b))
        for k in range(len(sizes), -1, -1):  # slot lane = sizes[:k], host lane = the suffix
            if k == 0:
                free, numel = bound - margin_bytes, self.slot_config.slot_numel
            else:
                free = bound - margin_bytes - prefix_max[k]
                numel = min(self.slot_config.slot_numel, (free // (ns * per)) // (64 << 10) * (64 << 10))
            if k == 0 or numel >= min_slot_numel:
                host = sum(n for n, _ in sizes[k:])
                slots = dataclasses.replace(self.slot_config, slot_numel=int(numel), num_slots=ns)
                return host / total, slots
        raise AssertionError("k == 0 always fits")  # pragma: no cover

    @property
    def split(self) -> float:
        """Current host-lane share of the staged elements."""
        self._ensure_layout()
        return sum(u.numel for u in self._host_units) / max(1, self.slabs.numel)

    # ------------------------------------------------------------ state access
    def drain(self, *, release: bool = True) -> None:
        super().drain(release=release)
        cu = self._cuda
        if cu is not None:
            cu["grad"].synchronize()
            cu["upload"].synchronize()
        if self._masters_stale:  # fp32 params updated in the slots: the host masters follow them
            plist = getattr(self, "_plist", [])
            for i in self._staged_idx:
                p = plist[i][1]
                o = self._offsets[i]
                self.slabs["master_param"][o:o + p.numel()].copy_(p.detach().reshape(-1))
            self._masters_stale = False
        if release:
            self._upload_buf = None

    def set_scaled_state(self, p: torch.Tensor, key: str, value: torch.Tensor) -> None:
        super().set_scaled_state(p, key, value)
        if key == "master_param" and self._param_is_master and self._is_staged(p):
            p.detach().copy_(value.reshape(p.shape))  # the parameter is the master

    def get_unscaled_state(self, p: torch.Tensor, key: str) -> torch.Tensor:
        t = super().get_unscaled_state(p, key)
        return t if t.dtype == torch.float32 else t.float()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self._param_is_master:
            for i in self._staged_idx:
                p = self._plist[i][1]
                p.detach().copy_(self.state[p]["master_param"])

    def _is_staged(self, p: torch.Tensor) -> bool:
        return id(p) in self._staged_ids

    # ------------------------------------------------------------ accounting
    @property
    def gpu_state_bytes(self) -> int:
        n = super().gpu_state_bytes
        if self._upload_buf is not None:
            n += self._upload_buf.numel() * self._upload_buf.element_size()
        return n

    @property
    def residency(self) -> dict[str, Any]:
        r = super().residency
        host_n = sum(u.numel for u in self._host_units)
        r.update(host_numel=host_n, host_fraction=host_n / max(1, self.slabs.numel),
                 grad_host_bytes=0 if self._grads is None else self._grads.nbytes,
                 param_is_master=self._param_is_master, offload_gradients=self.offload_gradients)
        return r

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes each step moves host->device (``h2d``) and device->host (``d2h``) in the current
        split, slot cache ignored: slot lane = its state keys each way; host lane = gradients down,
        fp32 weights up (the same with ``offload_gradients``: slot-lane gradients stay on the device)."""
        self._ensure_layout()
        size = {k: torch.empty((), dtype=d).element_size() for k, d in self._state_dtypes().items()}
        keys = _MOMENTS if self._param_is_master else self.state_keys
        ring_n = sum(u.numel for u in self._staged_units)
        host_n = sum(u.numel for u in self._host_units)
        per = sum(size[k] for k in keys)
        h2d = ring_n * per + 4 * host_n
        d2h = ring_n * per + 4 * host_n
        return {"h2d": h2d, "d2h": d2h, "host_numel": host_n, "ring_numel": ring_n}
