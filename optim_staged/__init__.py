"""CPU-staged AdamW and Muon for Megatron-Core: optimizer state in host slabs, streamed through
a few device slots. See ``docs/optim_staged.md``."""

from optim_staged.adamw import StagedAdamW
from optim_staged.config import (
    AdamWConfig,
    CheckpointLayoutError,
    HostMemoryError,
    MuonConfig,
    SlotConfig,
    SlotTooSmallError,
    StagedConfigError,
    StagedOptimizerConfig,
    UnsupportedMegatronConfigError,
)
from optim_staged.muon import StagedMuon
from optim_staged.reference import identity_orthogonalize, reference_adamw_step, reference_muon_step
from optim_staged.update import adamw_update_, muon_update_

__all__ = [
    "AdamWConfig",
    "CheckpointLayoutError",
    "HostMemoryError",
    "MuonConfig",
    "SlotConfig",
    "SlotTooSmallError",
    "StagedAdamW",
    "StagedConfigError",
    "StagedMuon",
    "StagedOptimizerConfig",
    "UnsupportedMegatronConfigError",
    "adamw_update_",
    "identity_orthogonalize",
    "muon_update_",
    "reference_adamw_step",
    "reference_muon_step",
]
