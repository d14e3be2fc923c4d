"""get_staged_optimizer names a wrong argument: a plain dict config, one model instead of a list, an
unwrapped model chunk."""

from __future__ import annotations

import pytest

from mcore_distill.errors import ConfigTypeError
from optim_staged import StagedOptimizerConfig


def test_unwrapped_model_and_dict_config(cpu_megatron):
    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt
    from optim_staged.megatron import get_staged_optimizer

    model = build_tiny_gpt(TinyGPTConfig())
    with pytest.raises(ConfigTypeError, match=r"model_chunks\[0\] is an unwrapped GPTModel: wrap it first.*"
                                              r"DistributedDataParallel"):
        get_staged_optimizer(StagedOptimizerConfig(), [model])
    with pytest.raises(ConfigTypeError, match=r"model_chunks must be a list of DDP-wrapped model chunks, got "
                                              r"GPTModel \(pass \[ddp_model\]\)"):
        get_staged_optimizer(StagedOptimizerConfig(), model)
    with pytest.raises(ConfigTypeError, match=r"config must be a StagedOptimizerConfig, got dict \(a plain dict"):
        get_staged_optimizer({"residency": "staged"}, [model])
