"""Shared machinery of :class:`StagedAdamW` and :class:`StagedMuon`: layout, slabs, residency.

The optimizer owns, per state key, one flat fp32 host slab covering every staged parameter in
``param_groups`` order (and, for ``staged_fraction < 1``, one device-resident slab for the rest).
``state[p][key]`` are views into those slabs, shaped like ``p``. The layout is rebuilt when
``param_groups`` change (e.g. when Megatron's DistributedOptimizer installs its shards).

Step counters are kept once per group (``group['step']``, a Python int) and advance on every
``step()`` for every group, also for groups that are empty on this rank, so all ranks agree.
A parameter whose gradient is ``None`` is skipped (its state is untouched) but the counter still
advances: this differs from ``torch.optim.AdamW``'s per-parameter counters only for parameters
that miss gradients in some steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from optim_staged.config import CheckpointLayoutError, SlotConfig
from optim_staged.slabs import SlotRing, StateSlabs

__all__ = ["StagedOptimizerBase", "grad_of"]


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer uses: Megatron's ``decoupled_grad`` when set, else ``p.grad``."""
    g = getattr(p, "decoupled_grad", None)
    return g if g is not None else p.grad


class StagedOptimizerBase(torch.optim.Optimizer):
    """Base class; subclasses set ``state_keys`` and define ``_units(entries, whole=)`` (slab ranges
    to stream) and ``_compute(unit, views, params, phases)`` (the update of one unit on its slot views;
    ``phases`` is None for device-resident units).

    NOTE: deviates from ``torch.optim.Optimizer`` in three places: state tensors live in host slabs
    (never moved to the parameter's device by ``load_state_dict``), step counters are per group,
    and ``state_dict()`` returns views of the slabs (call ``drain()`` first on CUDA; it does).
    """

    state_keys: tuple[str, ...] = ()
    late_keys: tuple[str, ...] = ()
    """State keys the update needs only at its end (their H2D may overlap the compute)."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, slots: SlotConfig | None = None,
                 staged_fraction: float = 1.0, device: torch.device | str | None = None) -> None:
        super().__init__(params, defaults)
        self.slot_config = slots or SlotConfig()
        if not 0.0 <= staged_fraction <= 1.0:
            from optim_staged.config import StagedConfigError

            raise StagedConfigError(f"staged_fraction={staged_fraction!r} is invalid: must be in [0, 1]")
        self.staged_fraction = float(staged_fraction)
        self._device_override = torch.device(device) if device is not None else None
        self._layout_key: tuple[int, ...] | None = None
        self._fences: list[Any] = []  # pending async saves reading the host slabs in place
        self._ring: SlotRing | None = None
        self.slabs: StateSlabs | None = None
        self.resident: StateSlabs | None = None
        for g in self.param_groups:
            g.setdefault("step", 0)

    # ------------------------------------------------------------------ layout
    def _params(self) -> list[tuple[int, torch.Tensor]]:
        return [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]

    @property
    def compute_device(self) -> torch.device:
        if self._device_override is not None:
            return self._device_override
        dev = getattr(self, "_dev", None)  # cached by _ensure_layout (hot path: once per unit)
        if dev is not None:
            return dev
        for _, p in self._params():
            return p.device
        return torch.device("cpu")

    def _ensure_layout(self) -> None:
        key = tuple(id(p) for _, p in self._params())
        if key == self._layout_key:
            return
        if self._ring is not None:
            self.drain(release=True)
        # Parameters that stay across a re-layout (e.g. add_param_group) keep their state.
        old_state = {id(p): v for p, v in self.state.items()} if self._layout_key is not None else {}
        plist = self._params()
        numels = [p.numel() for _, p in plist]
        total = sum(numels)
        cut = int(round(self.staged_fraction * total))
        staged, resident, acc = [], [], 0
        for i, n in enumerate(numels):
            (staged if acc < cut else resident).append(i)
            acc += n
        self._dev = None
        dev = self._dev = self.compute_device
        cfg = self.slot_config
        self._plist = plist
        self._staged_idx, self._resident_idx = staged, resident
        self._offsets: dict[int, int] = {}
        off = 0
        for i in staged:
            self._offsets[i] = off
            off += numels[i]
        self.slabs = StateSlabs(self.state_keys, off, device="cpu", pin=cfg.pin_memory and dev.type == "cuda",
                                memory_margin=cfg.host_memory_margin, dtype=self._state_dtypes(),
                                huge_pages=cfg.huge_pages)
        roff = 0
        for i in resident:
            self._offsets[i] = roff
            roff += numels[i]
        self.resident = StateSlabs(self.state_keys, roff, device=dev, dtype=self._state_dtypes()) if resident else None
        self._build_ring()
        # state[p] = views into the slabs; master initialised from the (possibly bf16) parameter.
        self.state.clear()
        staged_set = set(staged)
        for i, (_, p) in enumerate(plist):
            store = self.slabs if i in staged_set else self.resident
            o = self._offsets[i]
            views = {k: store[k][o:o + p.numel()].view(p.shape) for k in self.state_keys}
            if id(p) in old_state:
                for k in self.state_keys:
                    views[k].copy_(old_state[id(p)][k])
            else:
                views["master_param"].copy_(p.detach().reshape(p.shape).to(torch.float32))
            self.state[p] = views
        self._layout_key = key

    def _state_dtypes(self) -> dict[str, torch.dtype]:
        """dtype of each state key's slab (fp32 unless a subclass stores some keys narrower)."""
        return {k: torch.float32 for k in self.state_keys}

    def _ring_spec(self) -> dict[str, Any]:
        """How the slot ring is built: keys it streams, their dtypes, caching."""
        return {"keys": self.state_keys, "dtypes": self._state_dtypes(), "keep_resident": self.slot_config.keep_resident}

    def _build_ring(self) -> None:
        cfg, plist = self.slot_config, self._plist
        spec = self._ring_spec()
        self._ring = SlotRing(spec["keys"], slot_numel=cfg.slot_numel, num_slots=cfg.num_slots, device=self._dev,
                              late_keys=self.late_keys, keep_resident=spec["keep_resident"], dtypes=spec["dtypes"])
        self._staged_units = self._units([(i, plist[i][0], plist[i][1], self._offsets[i]) for i in self._staged_idx])
        self._resident_units = self._units(
            [(i, plist[i][0], plist[i][1], self._offsets[i]) for i in self._resident_idx], whole=True)

    # -------------------------------------------------------------- public API
    def add_fence(self, fence: Any) -> None:
        """Register a pending reader of the host slabs (``fence.wait()`` blocks until it is done,
        raising on its timeout or error); every call that writes host state waits for it first."""
        self._fences.append(fence)

    def _wait_fences(self) -> None:
        while self._fences:
            self._fences[0].wait()
            self._fences.pop(0)

    def set_slot_config(self, slots: SlotConfig) -> None:
        """Switch slot size/count/caching between steps: writes back and frees the current slots,
        keeps the host slabs (no reallocation, no re-pinning). ``pin_memory`` and
        ``host_memory_margin`` apply to the next slab allocation only."""
        self._wait_fences()
        self._ensure_layout()
        self._ring.drain(release=True)
        old = self.slot_config
        self.slot_config = slots
        try:
            self._build_ring()
        except Exception:
            self.slot_config = old
            self._build_ring()
            raise

    def initialize_state(self, p: torch.Tensor | None = None) -> None:
        """Allocate slabs (if needed) and initialise ``state[p]``; ``master_param`` <- fp32(p)."""
        self._ensure_layout()

    def prefetch(self) -> None:
        """Start moving the first slots' state to the device; needs no gradients, so it can run
        while gradients are still being reduced."""
        self._ensure_layout()
        if self._staged_units:
            self._ring.prefetch(self._staged_units, self.slabs, reverse=self._reverse_at(self._step_count() + 1))

    def _step_count(self) -> int:
        return int(self.param_groups[0].get("step", 0)) if self.param_groups else 0

    @staticmethod
    def _reverse_at(step: int) -> bool:
        # Walk order alternates per step (slot cache); from the step counter, so ranks agree.
        return step % 2 == 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if closure is not None:
            raise ValueError("closure is not supported by staged optimizers (pass closure=None)")
        self._wait_fences()
        self._ensure_layout()
        self._begin_step()
        params = [p for _, p in self._plist]
        self._run_staged(params)
        if self._resident_units:
            for u in self._resident_units:
                views = {k: self.resident[k][u.start:u.end] for k in self.state_keys}
                self._compute(u, views, params, None)
        return None

    def _run_staged(self, params: list[torch.Tensor]) -> None:
        """Update every staged unit (here: all through the slot ring)."""
        self._ring.run(self._staged_units, self.slabs, lambda u, v, ph: self._compute(u, v, params, ph),
                       reverse=self._reverse_at(self._step_count()))

    def _scratch(self, numel: int) -> torch.Tensor:
        """fp32 device scratch of ``numel`` elements for the unit being computed."""
        return self._ring.scratch(numel)

    def _begin_step(self) -> None:
        for g in self.param_groups:
            g["step"] = int(g.get("step", 0)) + 1

    def drain(self, *, release: bool = True) -> None:
        """Write back the state cached in slots and wait until all of it is in the host slabs
        (``state[p]`` views are current only after this); with ``release`` free the slots, so
        ``gpu_state_bytes`` is 0 when everything is staged."""
        if self._ring is not None:
            self._ring.drain(release=release)

    @property
    def gpu_state_bytes(self) -> int:
        """Accelerator bytes held for optimizer state: slot buffers plus resident slabs."""
        n = 0
        if self._ring is not None and self._ring.device.type == "cuda":
            n += self._ring.allocated_bytes
        if self.resident is not None and self.resident.device.type == "cuda":
            n += self.resident.nbytes
        return n

    @property
    def residency(self) -> dict[str, int | bool]:
        """Where state lives: staged/resident element counts, host and slot bytes, pinning."""
        self._ensure_layout()
        return {
            "staged_numel": self.slabs.numel,
            "resident_numel": 0 if self.resident is None else self.resident.numel,
            "host_bytes": self.slabs.nbytes,
            "pinned": self.slabs.pinned,
            "slot_bytes": self._ring.allocated_bytes,
            "num_slots": self._ring.num_slots,
            "slot_numel": self._ring.slot_numel,
            "num_units": len(self._staged_units),
        }

    # ----------------------------------------- Megatron precision-aware contract
    def get_unscaled_state(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """fp32 state tensor ``key`` of ``p`` (a view of its slab, after draining)."""
        self._ensure_layout()
        self.drain(release=False)
        return self.state[p][key]

    def set_scaled_state(self, p: torch.Tensor, key: str, value: torch.Tensor) -> None:
        """Copy ``value`` into state ``key`` of ``p`` (shape-checked)."""
        self._wait_fences()
        self._ensure_layout()
        self.drain(release=False)
        dst = self.state[p][key]
        if value.numel() != dst.numel():
            raise CheckpointLayoutError(
                f"state '{key}' of a parameter of shape {tuple(p.shape)}: checkpoint has {value.numel()} "
                f"elements, expected {dst.numel()}"
            )
        dst.copy_(value.reshape(dst.shape).to(dst.dtype))
        self._ring.forget()  # slot copies of this range are stale now

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """``{'state': {i: {key: view, 'step': tensor}}, 'param_groups': [...]}`` like torch."""
        self._ensure_layout()
        self.drain(release=False)
        index = {id(p): i for i, (_, p) in enumerate(self._plist)}
        groups = []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [index[id(p)] for p in g["params"]]})
        state = {}
        for i, (gi, p) in enumerate(self._plist):
            entry = dict(self.state[p])
            entry["step"] = torch.tensor(float(self.param_groups[gi]["step"]))
            state[i] = entry
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyper-parameters, step counters and state into *fresh* slabs; swap on success.

        Raises :class:`CheckpointLayoutError` (leaving the current state untouched) when groups,
        parameter counts, keys or sizes do not match. An entry missing a state key is an error:
        moments are never silently dropped.
        """
        self._wait_fences()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise CheckpointLayoutError(
                f"param_groups: checkpoint has {len(saved_groups)} groups, optimizer has {len(self.param_groups)}")
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise CheckpointLayoutError(
                    f"param_groups[{gi}]: checkpoint has {len(sg['params'])} params, optimizer has {len(g['params'])}")
        self._ensure_layout()
        self.drain(release=False)
        saved_state = state_dict.get("state", {})
        steps: list[int | None] = [None] * len(self.param_groups)
        staged = set(self._staged_idx)
        index = {id(q): k for k, (_, q) in enumerate(self._plist)}
        items = []  # (param index, entry), validated before anything is allocated or written
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            for sid, p in zip(sg["params"], g["params"]):
                entry = saved_state.get(sid)
                if entry is None:
                    raise CheckpointLayoutError(f"param_groups[{gi}]: no saved state for param id {sid}")
                for k in self.state_keys:
                    if k not in entry:
                        raise CheckpointLayoutError(
                            f"state of param id {sid} (shape {tuple(p.shape)}) lacks '{k}'; "
                            f"found keys {sorted(entry)}")
                    if entry[k].numel() != p.numel():
                        raise CheckpointLayoutError(
                            f"state '{k}' of param id {sid}: {entry[k].numel()} elements, expected {p.numel()}")
                if "step" in entry:
                    s = entry["step"]
                    steps[gi] = int(s.item() if isinstance(s, torch.Tensor) else s)
                items.append((index[id(p)], entry))
        # Loading our own state_dict() (Megatron does this while wiring the DistOpt and building
        # checkpoint templates): the tensors already are the slabs, so no second copy is made.
        aliased = all(entry[k].data_ptr() == self.state[self._plist[i][1]][k].data_ptr()
                      for i, entry in items for k in self.state_keys)
        if aliased:
            fresh, fresh_res = self.slabs, self.resident
        else:
            fresh = StateSlabs(self.state_keys, self.slabs.numel, device="cpu", pin=False,
                               memory_margin=self.slot_config.host_memory_margin, dtype=self._state_dtypes(),
                               huge_pages=self.slot_config.huge_pages)
            fresh_res = (StateSlabs(self.state_keys, self.resident.numel, device=self.resident.device,
                                    dtype=self._state_dtypes())
                         if self.resident is not None else None)
            for i, entry in items:
                p = self._plist[i][1]
                store = fresh if i in staged else fresh_res
                o = self._offsets[i]
                for k in self.state_keys:
                    store[k][o:o + p.numel()].copy_(entry[k].reshape(-1))
        # Success: swap in, re-pin, keep the hyper-parameters of the checkpoint.
        if self.slabs.pinned and not fresh.pinned:
            fresh.pin()
        self.slabs = fresh
        self.resident = fresh_res
        known = [s for s in steps if s is not None]
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
            if steps[gi] is not None:
                g["step"] = steps[gi]
            elif known:  # empty group on this rank: counter from the non-empty owners
                g["step"] = max(known)
        for i, (_, p) in enumerate(self._plist):
            store = self.slabs if i in staged else self.resident
            o = self._offsets[i]
            self.state[p] = {k: store[k][o:o + p.numel()].view(p.shape) for k in self.state_keys}
        self._ring.forget()
