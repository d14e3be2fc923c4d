"""Configuration of staged optimizers: algorithm (adamw | muon) chosen separately from residency.

Every dataclass here is ``kw_only`` and usable as a Hydra structured config; ``__post_init__``
validates and raises :class:`StagedConfigError` naming the field and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
]


class StagedConfigError(ValueError):
    """A configuration field has an invalid value (the message names the field and value)."""


class HostMemoryError(MemoryError):
    """Host RAM is too small for the pinned slabs (the message gives bytes needed and available)."""


class SlotTooSmallError(ValueError):
    """A whole-matrix unit (Muon) does not fit one transfer slot."""


class CheckpointLayoutError(ValueError):
    """A checkpoint does not match this optimizer's layout (shapes, keys, TP/PP sizes)."""


class UnsupportedMegatronConfigError(ValueError):
    """The Megatron ``OptimizerConfig`` / DDP config asks for something staging cannot do."""


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

    def __post_init__(self) -> None:
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
    impl: str = "auto"
    """Update kernel: PyTorch's fused AdamW, its foreach ops, or ``auto`` (chosen per unit: fused
    where the device supports it and the unit has at most ``fused_max_slices`` slices, else foreach)."""
    fused_max_slices: int | None = None
    """With ``impl='auto'``: most parameter slices per unit for the fused kernel; None: the measured
    default of the device (``optim_staged.update.FUSED_MAX_SLICES``)."""

    def __post_init__(self) -> None:
        _check(self.lr >= 0.0, "lr", self.lr, "must be >= 0")
        b1, b2 = self.betas
        _check(0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0, "betas", self.betas, "both must be in [0, 1)")
        _check(self.eps > 0.0, "eps", self.eps, "must be > 0")
        _check(self.weight_decay >= 0.0, "weight_decay", self.weight_decay, "must be >= 0")
        _check(self.impl in ("auto", "fused", "foreach"), "impl", self.impl, "one of auto|fused|foreach")
        _check(self.fused_max_slices is None or (isinstance(self.fused_max_slices, int) and self.fused_max_slices >= 1),
               "fused_max_slices", self.fused_max_slices, "must be None or an int >= 1")


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
    coefficient_type: str = "quintic"
    """Newton-Schulz coefficients (emerging-optimizers ``coefficient_type``)."""
    scale_mode: str = "spectral"
    """Update scale (``spectral``, ``shape_scaling``, ``unit_rms_norm``) on the full matrix shape."""
    extra_scale_factor: float = 1.0
    """Extra multiplier on the orthogonalized update."""
    fp32_matmul_prec: str = "medium"
    """``torch`` float32 matmul precision inside Newton-Schulz."""
    split_qkv: bool = True
    """Orthogonalize Q, K, V parts of a fused QKV weight separately."""
    tp_mode: str = "duplicated"
    """How a TP-sharded matrix is orthogonalized (see docs/optim_staged.md)."""
    scalar_lr: float | None = None
    """AdamW learning rate for non-matrix parameters (None: ``lr``)."""

    def __post_init__(self) -> None:
        _check(self.lr >= 0.0, "lr", self.lr, "must be >= 0")
        _check(0.0 <= self.momentum < 1.0, "momentum", self.momentum, "must be in [0, 1)")
        _check(self.weight_decay >= 0.0, "weight_decay", self.weight_decay, "must be >= 0")
        _check(self.num_ns_steps >= 1, "num_ns_steps", self.num_ns_steps, "must be >= 1")
        _check(self.tp_mode in ("duplicated", "distributed", "blockwise"), "tp_mode", self.tp_mode,
               "one of duplicated|distributed|blockwise")


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
        _check(isinstance(self.output_dir, str), "MemorySnapshotConfig.output_dir", self.output_dir, "must be a str")
        _check(isinstance(self.step, int) and self.step >= 1, "MemorySnapshotConfig.step", self.step,
               "must be an int >= 1")
        _check(isinstance(self.max_entries, int) and self.max_entries >= 1, "MemorySnapshotConfig.max_entries",
               self.max_entries, "must be an int >= 1")


@dataclass(kw_only=True, slots=True)
class StagedOptimizerConfig:
    """Top-level config: which algorithm, where its state lives, and how it streams."""

    algorithm: str = "adamw"
    """``adamw`` | ``muon`` (Muon uses AdamW for embeddings, norms and other non-matrix params)."""
    residency: str = "staged"
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
        _check(self.algorithm in ("adamw", "muon"), "algorithm", self.algorithm, "one of adamw|muon")
        _check(self.residency in ("gpu", "staged"), "residency", self.residency, "one of gpu|staged")
        _check(0.0 <= self.staged_fraction <= 1.0, "staged_fraction", self.staged_fraction,
               "must be in [0, 1]")
        _check(self.clip_grad >= 0.0, "clip_grad", self.clip_grad, "must be >= 0")
