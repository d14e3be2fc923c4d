"""``StagedMuon``: Muon whose fp32 master and momentum live in host slabs.

A unit is one whole (TP-local) matrix: Newton-Schulz needs the full matrix, so Muon units never
split. A matrix larger than ``slot_numel`` raises :class:`SlotTooSmallError` (no row splitting:
NS of a row block is not the row block of NS). Orthogonalization is delegated to a callable,
normally Megatron's ``TensorParallelMuon.orthogonalize`` (QKV split, TP ``duplicated`` /
``distributed`` modes, spectral/shape scaling), so results match the official Muon. Every unit
runs on the ring's single compute stream in parameter order (reversed on every other step, from
the step counter, for the slot cache), identical on all TP ranks, so the TP collectives inside
orthogonalization line up with any number of slots.

Per unit the momentum is copied in first; the master's H2D overlaps the momentum update and
Newton-Schulz, and the momentum's D2H starts as soon as it is final. Only 4 B/param has to arrive
before a unit's compute can start, and only 4 B/param leaves after it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from optim_staged.base import StagedOptimizerBase, grad_of
from optim_staged.config import MuonConfig, SlotConfig, SlotTooSmallError
from optim_staged.slabs import Piece, Unit
from optim_staged.update import muon_apply_, muon_momentum_

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
    late_keys = ("master_param",)  # needed only after Newton-Schulz: its H2D overlaps the NS

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
        try:
            from emerging_optimizers.utils import fp32_matmul_precision

            self._precision_ctx = fp32_matmul_precision
        except ImportError:  # pragma: no cover - emerging-optimizers is a dependency
            self._precision_ctx = None

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

    def _compute(self, unit: Unit, views: dict[str, torch.Tensor], params: list[torch.Tensor], phases) -> None:
        """Momentum (early key) -> its D2H may start -> orthogonalize -> wait for the master's H2D
        (late key) -> master update -> model param <- cast(master), all on the compute stream."""
        p = params[unit.pieces[0].param_index]
        grad = grad_of(p)
        if grad is None:
            return
        group = self.param_groups[unit.group]
        shape = p.shape
        if grad.dtype == torch.float32 and grad.is_contiguous():
            g = grad.view(shape)
        else:  # bf16 grads: one fp32 copy in the ring's scratch buffer
            g = self._scratch(p.numel()).view(shape)
            g.copy_(grad.view(shape), non_blocking=True)
        update = muon_momentum_(g, views["momentum_buffer"].view(shape), momentum=group["momentum"],
                                nesterov=group["nesterov"])
        if phases is not None:
            phases.early_done()
        group_kwargs = {k: v for k, v in group.items() if k != "params"}
        with self._matmul_precision():
            orth = self.orthogonalize(p, update, **group_kwargs)
        if phases is not None:
            phases.wait_late()
        master = views["master_param"].view(shape)
        muon_apply_(master, orth, lr=float(group["lr"]), weight_decay=group["weight_decay"])
        p.detach().copy_(master)

    def _matmul_precision(self):
        if self._precision_ctx is None:
            return contextlib.nullcontext()
        return self._precision_ctx(self.fp32_matmul_prec)
