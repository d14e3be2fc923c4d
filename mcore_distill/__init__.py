"""mcore-distill: Megatron-Core plugins for RL distillation of LLMs.

Shared foundations live here: :mod:`mcore_distill.cpu_compat` (run Megatron-Core on CPU/gloo),
:mod:`mcore_distill.testing` (tiny Megatron GPT, multi-rank launcher, assertions),
:mod:`mcore_distill.errors` (base error classes), :mod:`mcore_distill.atomic` (crash-safe file and
directory writes), :mod:`mcore_distill.validate` (config field checks) and :mod:`mcore_distill.hf`
(Hugging Face checkpoints in and out of Megatron).
"""

__version__ = "0.1.0"
