"""mcore-distill: Megatron-Core plugins for RL distillation of LLMs.

Shared foundations live here: :mod:`mcore_distill.cpu_compat` (run Megatron-Core on CPU/gloo)
and :mod:`mcore_distill.testing` (tiny Megatron GPT, multi-rank launcher, assertions).
"""

__version__ = "0.1.0"
