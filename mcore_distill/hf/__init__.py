"""Hugging Face checkpoints in and out of Megatron-Core (Qwen3, Qwen3-MoE, Qwen3-Next/Qwen3.5 hybrids).

* :func:`transformer_config_from_hf` — the Megatron ``TransformerConfig`` (+ ``GPTModel`` arguments,
  padded vocabulary) of an HF folder.
* :func:`megatron_model_from_hf` — this rank's model chunk(s) with the weights loaded, in the
  layout of Megatron's ``parallel_state`` (TP, PP, EP, ETP).
* :func:`load_hf_checkpoint` / :func:`save_hf_checkpoint` — into a model you built / out to a
  sharded safetensors folder with ``config.json``, the index and tokenizer files.

One mapping table per architecture (:mod:`mcore_distill.hf.mapping`) over the layouts of
:mod:`mcore_distill.hf.layouts` serves loading, saving and :mod:`colocate`'s publication.
``megatron.core`` is imported only when a function needs it. See ``docs/hf.md``.
"""

from mcore_distill.hf.config import (
    HFArch,
    MegatronHFConfig,
    arch_from_megatron,
    hf_arch,
    hf_config_dict,
    pad_vocab_size,
    read_hf_config,
    transformer_config_from_hf,
)
from mcore_distill.hf.errors import (
    CheckpointFileError,
    CheckpointMismatchError,
    ConfigMismatchError,
    ConversionError,
    HFCheckpointError,
    PeerRankError,
    UnsupportedConfigError,
    VocabSizeError,
)
from mcore_distill.hf.megatron import (
    LoadReport,
    SaveReport,
    load_hf_checkpoint,
    megatron_model_from_hf,
    save_hf_checkpoint,
)

__all__ = [
    "transformer_config_from_hf",
    "megatron_model_from_hf",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "HFArch",
    "MegatronHFConfig",
    "LoadReport",
    "SaveReport",
    "read_hf_config",
    "hf_arch",
    "hf_config_dict",
    "arch_from_megatron",
    "pad_vocab_size",
    "HFCheckpointError",
    "ConversionError",
    "UnsupportedConfigError",
    "ConfigMismatchError",
    "VocabSizeError",
    "CheckpointMismatchError",
    "CheckpointFileError",
    "PeerRankError",
]
