"""Real-architecture MOPD runner (Hydra configs in ``examples/configs/``); see ``docs/demo.md``."""
