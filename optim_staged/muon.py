"""``StagedMuon``: Muon whose fp32 master and momentum live in host slabs.

A unit is one whole (TP-local) matrix: Newton-Schulz needs the full matrix, so Muon units never
split. A matrix larger than ``slot_numel`` raises :class:`SlotTooSmallError` (no row splitting:
NS of a row block is not the row block of NS). Orthogonalization is delegated to a callable,
normally Megatron's ``TensorParallelMuon.orthogonalize`` (QKV split, TP ``duplicated`` /
``distributed`` modes, spectral/shape scaling), so results match the official Muon. Every unit
runs on the ring's single compute stream in parameter order, identical on all TP ranks, so the
TP collectives inside orthogonalization line up with any number of slots.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from optim_staged.base import StagedOptimizerBase, grad_of
from optim_staged.config import MuonConfig, SlotConfig, SlotTooSmallError
from optim_staged.slabs import Piece, Unit
from optim_staged.update import muon_update_

__all__ = ["StagedMuon", "newton_schulz_orthogonalize"]

Orthogonalize = Callable[..., torch.Tensor]  # (param, update, **group_kwargs) -> orthogonalized update


def newton_schulz_orthogonalize(*, num_ns_steps: int = 5, coefficient_type: str = "quintic",
                                scale_mode: str = "spectral", extra_scale_factor: float = 1.0) -> Orthogonalize:
    """emerging-optimizers Newton-Schulz with Muon's scale on an untied matrix (no TP)."""
    from emerging_optimizers.orthogonalized_optimizers import get_muon_scale_factor
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    def orth(p: torch.Tensor, u: torch.Tensor, **_: Any) -> torch.Tensor:
        o = newton_schulz(u, num_ns_steps, coefficient_type)
        return o * get_muon_scale_factor(u.size(-2), u.size(-1), mode=scale_mode) * extra_scale_factor

    return orth


class StagedMuon(StagedOptimizerBase):
    """Muon (emerging-optimizers semantics, decoupled weight decay) with host-staged state.

    Args:
        params: 2-D parameters or groups of them.
        lr, momentum, nesterov, weight_decay: Muon hyper-parameters (per group, changeable).
        orthogonalize: ``f(param, update, **group_kwargs) -> Tensor``; default Newton-Schulz
            (quintic, 5 steps, spectral scale).
        fp32_matmul_prec: ``torch`` float32 matmul precision inside ``orthogonalize``.
        slots: slot config; ``slot_numel`` must hold the largest matrix.

    ``state[p]`` holds ``master_param`` and ``momentum_buffer`` (fp32 views of the slabs).
    """

    state_keys = ("master_param", "momentum_buffer")

    def __init__(self, params: Iterable[Any], lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = False,
                 weight_decay: float = 0.01, *, orthogonalize: Orthogonalize | None = None,
                 fp32_matmul_prec: str = "medium", slots: SlotConfig | None = None,
                 device: torch.device | str | None = None) -> None:
        MuonConfig(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)  # validates
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
        super().__init__(params, defaults, slots=slots, staged_fraction=1.0, device=device)
        for gi, g in enumerate(self.param_groups):
            for j, p in enumerate(g["params"]):
                if p.dim() != 2:
                    raise ValueError(f"param_groups[{gi}]['params'][{j}] has shape {tuple(p.shape)}: "
                                     "StagedMuon takes 2-D matrices (use StagedAdamW for the rest)")
        self.orthogonalize = orthogonalize or newton_schulz_orthogonalize()
        self.fp32_matmul_prec = fp32_matmul_prec

    @classmethod
    def from_tensor_parallel_muon(cls, tpm: torch.optim.Optimizer, *, slots: SlotConfig | None = None) -> StagedMuon:
        """Staged twin of a Megatron ``TensorParallelMuon`` (or emerging-optimizers Muon): same
        param groups and hyper-parameters; orthogonalization through ``tpm.orthogonalize``."""
        groups = [dict(g) for g in tpm.param_groups]
        return cls(groups, lr=groups[0]["lr"], momentum=groups[0]["momentum"], nesterov=tpm.nesterov,
                   weight_decay=groups[0]["weight_decay"], orthogonalize=tpm.orthogonalize,
                   fp32_matmul_prec=tpm.fp32_matmul_prec, slots=slots)

    def _units(self, entries, *, whole: bool = False) -> list[Unit]:
        units = []
        limit = self.slot_config.slot_numel
        for i, g, p, o in entries:
            if p.numel() > limit and not whole:
                raise SlotTooSmallError(
                    f"matrix {tuple(p.shape)} ({p.numel()} elements) does not fit slot_numel={limit}; "
                    f"raise SlotConfig.slot_numel to >= {p.numel()} (Muon units are whole matrices)")
            if p.numel():
                units.append(Unit(g, o, o + p.numel(), (Piece(i, 0, p.numel(), 0),), tuple(p.shape)))
        return units

    def _compute(self, unit: Unit, views: dict[str, torch.Tensor], params: list[torch.Tensor]) -> None:
        p = params[unit.pieces[0].param_index]
        grad = grad_of(p)
        if grad is None:
            return
        group = self.param_groups[unit.group]
        shape = p.shape
        gbuf = views["grad"]
        gbuf = (torch.empty(shape, dtype=torch.float32, device=views["master_param"].device) if gbuf is None
                else gbuf.view(shape))
        gbuf.copy_(grad.view(shape), non_blocking=True)
        master = views["master_param"].view(shape)
        group_kwargs = {k: v for k, v in group.items() if k != "params"}
        try:
            from emerging_optimizers.utils import fp32_matmul_precision

            prec = fp32_matmul_precision(self.fp32_matmul_prec)
        except ImportError:  # pragma: no cover - emerging-optimizers is a dependency
            prec = contextlib.nullcontext()
        with prec:
            muon_update_(master, gbuf, views["momentum_buffer"].view(shape), lr=float(group["lr"]),
                         momentum=group["momentum"], nesterov=group["nesterov"],
                         weight_decay=group["weight_decay"],
                         orthogonalize=lambda u: self.orthogonalize(p, u, **group_kwargs))
        p.detach().copy_(master)
