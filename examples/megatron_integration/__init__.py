"""Add mcore-distill to a Megatron-Core training loop: ``plain.py`` (the loop) and ``train.py`` (the
loop plus a CPU-staged optimizer, an MOPD loss with a frozen teacher, and harts tree packing).
See docs/integration.md."""
