"""Configuration of staged optimizers: algorithm (adamw | muon) chosen separately from residency.

Every dataclass here is ``kw_only`` and usable as a Hydra structured config; ``__post_init__``
validates and raises :class:`StagedConfigError` naming the field and the value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mcore_distill.validate import validate_fields
from optim_staged.errors import (
    CheckpointLayoutError,
    HostMemoryError,
    SlotTooSmallError,
    StagedConfigError,
    StagedConfigTypeError,
    UnsupportedMegatronConfigError,
)

__all__ = [
    "StagedConfigError",
    "HostMemoryError",
    "SlotTooSmallError",
    "CheckpointLayoutError",
    "UnsupportedMegatronConfigError",
    "SlotConfig",
    "AdamWConfig",
    "MuonConfig",
    "MemorySnapshotConfig",
    "StagedOptimizerConfig",
    "AdamWImpl",
    "MuonTPMode",
    "NSCoefficients",
    "MuonScaleMode",
    "MatmulPrecision",
    "Algorithm",
    "Residency",
    "MomentDtype",
]


class AdamWImpl(enum.StrEnum):
    """AdamW update kernel."""

    auto = "auto"
    fused = "fused"
    foreach = "foreach"


class MuonTPMode(enum.StrEnum):
    """How a TP-sharded matrix is orthogonalized (Megatron ``TensorParallelMuon`` modes)."""

    duplicated = "duplicated"
    distributed = "distributed"
    blockwise = "blockwise"


class NSCoefficients(enum.StrEnum):
    """Newton-Schulz coefficient sets of emerging-optimizers (``coefficient_type``)."""

    simple = "simple"
    quintic = "quintic"
    polar_express = "polar_express"
    cans = "cans"
    aol = "aol"
    deepseekv4 = "deepseekv4"


class MuonScaleMode(enum.StrEnum):
    """Scale of the orthogonalized update (emerging-optimizers ``scale_mode``)."""

    spectral = "spectral"
    shape_scaling = "shape_scaling"
    unit_rms_norm = "unit_rms_norm"


class MatmulPrecision(enum.StrEnum):
    """``torch.set_float32_matmul_precision`` values."""

    highest = "highest"
    high = "high"
    medium = "medium"


class Algorithm(enum.StrEnum):
    adamw = "adamw"
    muon = "muon"


class Residency(enum.StrEnum):
    gpu = "gpu"
    staged = "staged"


def _validate(obj: object) -> None:
    validate_fields(obj, error=StagedConfigError, type_error=StagedConfigTypeError)


class MomentDtype(enum.StrEnum):
    """Storage dtype of an AdamW moment."""

    fp32 = "fp32"
    bf16 = "bf16"


MOMENT_DTYPES = tuple(MomentDtype)
"""Storage dtypes AdamW moments may use (names as in ``AdamWConfig``)."""


def _check(cond: bool, name: str, value: object, need: str) -> None:
    if not cond:
        raise StagedConfigError(f"{name}={value!r} is invalid: {need}")


@dataclass(kw_only=True, slots=True)
class SlotConfig:
    """How optimizer state streams through the accelerator."""

    slot_numel: int = 4 * 1024 * 1024
    """Elements per state tensor in one slot (fp32: 4 Mi elements = 16 MiB per tensor). AdamW units
    are contiguous ranges of this many elements; a Muon unit is one whole matrix and must fit."""
    num_slots: int = 3
    """Slots in the ring. 3 lets H2D(n+1), compute(n) and D2H(n-1) run at once without a slot
    waiting for its own write-back; 2 already overlaps, but stalls briefly per unit."""
    keep_resident: bool = True
    """Use the slots as a write-back cache: the last ``num_slots`` units of a step stay on the
    device and the next step walks units in reverse, starting on them with no transfer. Host
    ``state[p]`` views are then current after ``drain()`` (which ``state_dict()`` calls)."""
    pin_memory: bool = True
    """Pin host slabs (CUDA only) by registering exactly-sized host memory with the driver, so
    the pinned host allocator's power-of-two rounding never applies."""
    host_memory_margin: float = 0.9
    """Fraction of currently available host RAM the slabs may use; more raises HostMemoryError."""
    huge_pages: bool = True
    """Back host slabs of >= 2 MiB with an anonymous mapping advised ``MADV_HUGEPAGE`` (Linux; the
    kernel's transparent-huge-page setting decides). 2 MiB pages cut the TLB misses of the host
    AdamW lane's sweeps and sped the slot lane up (measured on the H200 box in docs/benchmarks.md).
    The kernel may compact memory to back them, so building the slabs can take longer (1.9 s
    instead of 0.2 s for 1 GiB once on the development machine); False: ``torch.zeros``."""

    def __post_init__(self) -> None:
        _validate(self)
        _check(self.slot_numel >= 1024, "slot_numel", self.slot_numel, "must be >= 1024 elements")
        _check(1 <= self.num_slots <= 16, "num_slots", self.num_slots, "must be in [1, 16]")
        _check(0.0 < self.host_memory_margin <= 1.0, "host_memory_margin", self.host_memory_margin,
               "must be in (0, 1]")


@dataclass(kw_only=True, slots=True)
class AdamWConfig:
    """AdamW hyper-parameters (decoupled weight decay, no AMSGrad)."""

    lr: float = 1e-3
    """Learning rate (per-group ``lr`` in ``param_groups`` overrides it between steps)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """(beta1, beta2) of the first and second moments."""
    eps: float = 1e-8
    """Added to sqrt(v_hat)."""
    weight_decay: float = 0.01
    """Decoupled weight decay: p <- p * (1 - lr * wd)."""
    impl: AdamWImpl = AdamWImpl.auto
    """Update kernel: PyTorch's fused AdamW, its foreach ops, or ``auto`` (chosen per unit: fused
    where the device supports it and the unit has at most ``fused_max_slices`` slices, else foreach)."""
    fused_max_slices: int | None = None
    """With ``impl='auto'``: most parameter slices per unit for the fused kernel; None: the measured
    default of the device (``optim_staged.update.FUSED_MAX_SLICES``)."""
    host_fraction: float = 0.0
    """Share of the staged elements (the trailing ones, whose gradients the backward pass produces
    first) updated by the host CPU (PyTorch's fused CPU AdamW on the host slabs: 4 B/param of
    gradient down and 4 B/param of weights up) instead of streaming through the GPU slots (12 B/param
    each way; 8 with fp32 parameters). Both halves run at the same time. 0 keeps every update on
    the GPU, bitwise equal to ``torch.optim.AdamW(fused=True)``."""
    auto_balance: bool = False
    """Search the host share on the measured step time over the first ``balance_steps`` steps
    (starting from ``host_fraction``, steps of 0.1 halved when neither neighbour is faster), then
    keep the fastest (a fixed split keeps runs reproducible)."""
    balance_steps: int = 8
    """Steps over which ``auto_balance`` adjusts the split."""
    exp_avg_dtype: MomentDtype = MomentDtype.fp32
    """Storage dtype of the first moment: ``fp32`` or ``bf16`` (halves its bytes; the update itself
    runs in fp32; see docs/optim_staged.md for the error bound)."""
    exp_avg_sq_dtype: MomentDtype = MomentDtype.fp32
    """Storage dtype of the second moment: ``fp32`` or ``bf16``."""

    def __post_init__(self) -> None:
        _validate(self)
        _check(self.lr >= 0.0, "lr", self.lr, "must be >= 0")
        b1, b2 = self.betas
        _check(0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0, "betas", self.betas, "both must be in [0, 1)")
        _check(self.eps > 0.0, "eps", self.eps, "must be > 0")
        _check(self.weight_decay >= 0.0, "weight_decay", self.weight_decay, "must be >= 0")
        _check(0.0 <= self.host_fraction <= 1.0, "host_fraction", self.host_fraction, "must be in [0, 1]")
        _check(self.balance_steps >= 1, "balance_steps", self.balance_steps, "must be >= 1")
        _check(self.fused_max_slices is None or self.fused_max_slices >= 1, "fused_max_slices",
               self.fused_max_slices, "must be None or >= 1")


@dataclass(kw_only=True, slots=True)
class MuonConfig:
    """Muon hyper-parameters, in emerging-optimizers / Megatron ``TensorParallelMuon`` semantics."""

    lr: float = 3e-4
    """Learning rate."""
    momentum: float = 0.95
    """beta of buf <- lerp(buf, g, 1 - beta)."""
    nesterov: bool = False
    """Use u = lerp(g, buf, beta) instead of buf."""
    weight_decay: float = 0.01
    """Decoupled: p <- p - lr * wd * p."""
    num_ns_steps: int = 5
    """Newton-Schulz iterations."""
    coefficient_type: NSCoefficients = NSCoefficients.quintic
    """Newton-Schulz coefficients (emerging-optimizers ``coefficient_type``)."""
    scale_mode: MuonScaleMode = MuonScaleMode.spectral
    """Update scale (``spectral``, ``shape_scaling``, ``unit_rms_norm``) on the full matrix shape."""
    extra_scale_factor: float = 1.0
    """Extra multiplier on the orthogonalized update."""
    fp32_matmul_prec: MatmulPrecision = MatmulPrecision.medium
    """``torch`` float32 matmul precision inside Newton-Schulz."""
    split_qkv: bool = True
    """Orthogonalize Q, K, V parts of a fused QKV weight separately."""
    tp_mode: MuonTPMode = MuonTPMode.duplicated
    """How a TP-sharded matrix is orthogonalized (see docs/optim_staged.md)."""
    scalar_lr: float | None = None
    """AdamW learning rate for non-matrix parameters (None: ``lr``)."""

    def __post_init__(self) -> None:
        _validate(self)
        _check(self.lr >= 0.0, "lr", self.lr, "must be >= 0")
        _check(0.0 <= self.momentum < 1.0, "momentum", self.momentum, "must be in [0, 1)")
        _check(self.weight_decay >= 0.0, "weight_decay", self.weight_decay, "must be >= 0")
        _check(self.num_ns_steps >= 1, "num_ns_steps", self.num_ns_steps, "must be >= 1")
        _check(self.extra_scale_factor > 0.0, "extra_scale_factor", self.extra_scale_factor, "must be > 0")
        _check(self.scalar_lr is None or self.scalar_lr >= 0.0, "scalar_lr", self.scalar_lr, "must be >= 0")


@dataclass(kw_only=True, slots=True)
class MemorySnapshotConfig:
    """A CUDA caching-allocator snapshot of one whole training iteration (forward, backward,
    optimizer step), for ``pytorch.org/memory_viz``; see :class:`optim_staged.memory.AllocatorSnapshot`."""

    output_dir: str = ""
    """Folder for ``optim_staged_alloc_step<step>_rank<rank>.pickle`` (the run's output folder);
    empty: no snapshot."""
    step: int = 2
    """Training iteration to record, counted in optimizer steps from 1 (step 1 includes one-time
    allocations such as slots; step 2 is the steady state)."""
    max_entries: int = 100_000
    """Allocator events kept (``torch.cuda.memory._record_memory_history(max_entries=...)``)."""

    def __post_init__(self) -> None:
        _validate(self)
        _check(self.step >= 1, "MemorySnapshotConfig.step", self.step, "must be >= 1")
        _check(self.max_entries >= 1, "MemorySnapshotConfig.max_entries", self.max_entries, "must be >= 1")


@dataclass(kw_only=True, slots=True)
class StagedOptimizerConfig:
    """Top-level config: which algorithm, where its state lives, and how it streams."""

    algorithm: Algorithm = Algorithm.adamw
    """``adamw`` | ``muon`` (Muon uses AdamW for embeddings, norms and other non-matrix params)."""
    residency: Residency = Residency.staged
    """``gpu`` | ``staged``. ``gpu``: state lives on the accelerator (plain Megatron optimizer). ``staged``: state lives in
    host slabs and streams through slots."""
    staged_fraction: float = 1.0
    """Fraction of state elements, counted in parameter order, kept in host slabs; the trailing
    parameters past that fraction keep accelerator-resident state. Used when ``residency='staged'``."""
    slots: SlotConfig = field(default_factory=SlotConfig)
    """Slot ring settings."""
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    """AdamW hyper-parameters (also Muon's scalar optimizer)."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon hyper-parameters (used when ``algorithm='muon'``)."""
    clip_grad: float = 1.0
    """Global grad-norm clip passed to Megatron (0 disables)."""
    memory_snapshot: MemorySnapshotConfig = field(default_factory=MemorySnapshotConfig)
    """CUDA allocator snapshot of one training iteration (off unless ``output_dir`` is set)."""

    def __post_init__(self) -> None:
        _validate(self)
        _check(0.0 <= self.staged_fraction <= 1.0, "staged_fraction", self.staged_fraction,
               "must be in [0, 1]")
        _check(self.clip_grad >= 0.0, "clip_grad", self.clip_grad, "must be >= 0")
