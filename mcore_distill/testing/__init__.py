"""Test and demo utilities shared by every package: tiny Megatron GPT, ranks, seeding, asserts."""

from mcore_distill.testing.assertions import assert_close
from mcore_distill.testing.dist import (
    RankFailed,
    RankTimeout,
    destroy_megatron,
    free_port,
    init_megatron,
    run_ranks,
    seed_all,
)
from mcore_distill.testing.gpt import TinyGPTConfig, build_tiny_gpt, transformer_config

__all__ = [
    "RankFailed",
    "RankTimeout",
    "TinyGPTConfig",
    "assert_close",
    "build_tiny_gpt",
    "destroy_megatron",
    "free_port",
    "init_megatron",
    "run_ranks",
    "seed_all",
    "transformer_config",
]
