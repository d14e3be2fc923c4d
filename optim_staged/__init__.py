"""CPU-staged AdamW and Muon for Megatron-Core: optimizer state in host slabs, streamed through
a few device slots. See ``docs/optim_staged.md``.

Exports what a trainer calls: ``get_staged_optimizer`` in place of ``get_megatron_optimizer``,
its checkpoint functions, the configs, the standalone optimizers and the errors. The Megatron
names live in :mod:`optim_staged.megatron` (the only submodule importing ``megatron.core``) and
are loaded on first use, so ``import optim_staged`` needs only torch. Everything else is imported
from its module: ``StagedDistributedOptimizer``, ``staged_leaves`` and the Megatron config
helpers from :mod:`optim_staged.megatron`, the update kernels from :mod:`optim_staged.update`,
plain-torch references from :mod:`optim_staged.reference`, slabs and slots from
:mod:`optim_staged.slabs`, the checkpoint layout from :mod:`optim_staged.checkpoint`.
"""

from optim_staged.adamw import StagedAdamW
from optim_staged.config import (
    AdamWConfig,
    MemorySnapshotConfig,
    MuonConfig,
    SlotConfig,
    StagedOptimizerConfig,
)
from optim_staged.errors import (
    CheckpointLayoutError,
    CheckpointWriteError,
    HostMemoryError,
    SlotTooSmallError,
    StagedConfigError,
    StagedError,
    UnsupportedMegatronConfigError,
)
from optim_staged.muon import StagedMuon

_MEGATRON = ("get_staged_optimizer", "save_checkpoint", "load_checkpoint", "async_save_checkpoint")

__all__ = [
    *_MEGATRON,
    "StagedOptimizerConfig", "AdamWConfig", "MuonConfig", "SlotConfig", "MemorySnapshotConfig",
    "StagedAdamW", "StagedMuon",
    "StagedError", "StagedConfigError", "HostMemoryError", "SlotTooSmallError", "CheckpointLayoutError",
    "CheckpointWriteError", "UnsupportedMegatronConfigError",
]


def __getattr__(name):
    if name in _MEGATRON:
        from optim_staged import megatron

        return getattr(megatron, name)
    raise AttributeError(f"module 'optim_staged' has no attribute {name!r}")
