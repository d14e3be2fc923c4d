"""mcore-distill: Megatron-Core plugins for RL distillation of LLMs.

The plugins are the packages ``mopd``, ``harts``, ``optim_staged``, ``colocate`` and
``shared_teacher``. This package holds what they share, imported from its modules:
:mod:`mcore_distill.cpu_compat` (run Megatron-Core on CPU/gloo), :mod:`mcore_distill.testing`
(tiny Megatron GPT, multi-rank launcher, assertions), :mod:`mcore_distill.errors` (base error
classes), :mod:`mcore_distill.atomic` (crash-safe file and directory writes),
:mod:`mcore_distill.validate` (config field checks), :mod:`mcore_distill.structured` (configs from
mappings and Hydra nodes, unknown keys refused) and :mod:`mcore_distill.hf` (Hugging Face
checkpoints in and out of Megatron).

It exports only the base errors, which a trainer catches for every package at once:
``except mcore_distill.McoreDistillError`` (any error raised by mcore-distill) or
``except mcore_distill.ConfigError`` (a bad value in any package's config).
"""

from mcore_distill.errors import ConfigError, ConfigTypeError, McoreDistillError

__version__ = "0.1.0"

__all__ = ["McoreDistillError", "ConfigError", "ConfigTypeError"]
