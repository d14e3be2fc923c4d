"""CPU end-to-end multi-teacher on-policy distillation demo (see ``docs/demo.md``)."""
