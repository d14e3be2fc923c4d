"""``StagedAdamW``: AdamW whose fp32 master, exp_avg and exp_avg_sq live in host slabs.

Each ``step()`` streams contiguous slab ranges ("units", at most ``slot_numel`` elements, which
may split parameters) through the slot ring: H2D of (master, m, v) -> one PyTorch AdamW kernel
call over the unit's pieces (fp32 gradients are read in place, others are cast into one fp32
scratch buffer) -> write the parameter pieces from the master (cast to the parameter dtype,
e.g. bf16) -> D2H."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from optim_staged.base import StagedOptimizerBase, grad_of
from optim_staged.config import AdamWConfig, SlotConfig
from optim_staged.flat import read_flat_range, write_flat_range
from optim_staged.slabs import Piece, Unit, build_units
from optim_staged.update import adamw_update_, choose_adamw_impl

__all__ = ["StagedAdamW"]


class StagedAdamW(StagedOptimizerBase):
    """AdamW (decoupled weight decay, no AMSGrad) with host-staged state.

    Args:
        params: parameters or param-group dicts (any float dtype; CUDA or CPU).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; per-group values may change
            between steps.
        slots: slot size/count and pinning (:class:`~optim_staged.config.SlotConfig`).
        staged_fraction: fraction of elements (parameter order) whose state is staged; the rest
            stays on the parameters' device.
        impl: ``auto`` | ``fused`` | ``foreach`` update kernel; ``auto`` chooses per unit by its
            number of slices (:func:`~optim_staged.update.choose_adamw_impl`).
        fused_max_slices: with ``auto``, most slices per unit for the fused kernel (None: the
            measured default of the device).

    ``state[p]`` holds ``master_param``, ``exp_avg``, ``exp_avg_sq`` (fp32 views of the slabs).
    """

    state_keys = ("master_param", "exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, slots: SlotConfig | None = None,
                 staged_fraction: float = 1.0, impl: str = "auto", fused_max_slices: int | None = None,
                 device: torch.device | str | None = None) -> None:
        AdamWConfig(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, impl=impl,
                    fused_max_slices=fused_max_slices)  # validates
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.impl = impl
        self.fused_max_slices = fused_max_slices
        super().__init__(params, defaults, slots=slots, staged_fraction=staged_fraction, device=device)
        self._step_tensors: dict[tuple[int, torch.device], torch.Tensor] = {}

    @classmethod
    def from_config(cls, params: Iterable[Any], cfg: AdamWConfig, *, slots: SlotConfig | None = None,
                    staged_fraction: float = 1.0) -> StagedAdamW:
        return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                   slots=slots, staged_fraction=staged_fraction, impl=cfg.impl, fused_max_slices=cfg.fused_max_slices)

    def _units(self, entries, *, whole: bool = False) -> list[Unit]:
        if not entries:
            return []
        if whole:
            return [Unit(g, o, o + p.numel(), (Piece(i, 0, p.numel(), 0),)) for i, g, p, o in entries if p.numel()]
        units = build_units([p.numel() for _, _, p, _ in entries], [o for *_, o in entries],
                            [g for _, g, _, _ in entries], slot_numel=self.slot_config.slot_numel)
        # build_units indexes entries positionally; map back to parameter indices.
        idx = [i for i, *_ in entries]
        return [Unit(u.group, u.start, u.end,
                     tuple(Piece(idx[pc.param_index], pc.p_start, pc.numel, pc.unit_offset) for pc in u.pieces))
                for u in units]

    def _begin_step(self) -> None:
        super()._begin_step()
        dev = self.compute_device
        # One step tensor per group, filled once on the host side of the step (no per-param sync).
        for gi, g in enumerate(self.param_groups):
            key = (gi, dev)
            t = self._step_tensors.get(key)
            if t is None:
                t = self._step_tensors[key] = torch.zeros((), dtype=torch.float32, device=dev)
            t.fill_(float(g["step"]))

    def _compute(self, unit: Unit, views: dict[str, torch.Tensor], params: list[torch.Tensor], phases) -> None:
        g = self.param_groups[unit.group]
        masters, grads, ms, vs, live = [], [], [], [], []
        scratch = None
        for pc in unit.pieces:
            p = params[pc.param_index]
            grad = grad_of(p)
            if grad is None:
                continue
            sl = slice(pc.unit_offset, pc.unit_offset + pc.numel)
            piece = grad.reshape(-1)[pc.p_start:pc.p_start + pc.numel] if grad.is_contiguous() else None
            if piece is None or piece.dtype != torch.float32:  # e.g. bf16 grads: fp32 copy on the device
                if scratch is None:
                    scratch = self._scratch(unit.numel)
                read_flat_range(grad, pc.p_start, scratch[sl], non_blocking=True)  # any strides
                piece = scratch[sl]
            masters.append(views["master_param"][sl])
            grads.append(piece)
            ms.append(views["exp_avg"][sl])
            vs.append(views["exp_avg_sq"][sl])
            live.append(pc)
        if not live:
            return
        beta1, beta2 = g["betas"]
        adamw_update_(masters, grads, ms, vs, step=self._step_tensors[(unit.group, self.compute_device)],
                      lr=float(g["lr"]), beta1=beta1, beta2=beta2, eps=g["eps"],
                      weight_decay=g["weight_decay"], impl=self._unit_impl(len(live), masters[0]),
                      step_value=g["step"])
        for pc, m in zip(live, masters):
            write_flat_range(params[pc.param_index].detach(), pc.p_start, m)  # view(-1) when contiguous

    def _unit_impl(self, num_slices: int, sample: torch.Tensor) -> str:
        """The AdamW kernel for one unit: ``impl``, or with ``auto`` the per-unit choice by slice count."""
        if self.impl != "auto":
            return self.impl
        return choose_adamw_impl(num_slices, sample, self.fused_max_slices)
