"""A run's checkpoint out: the release layout, a merged LoRA, PEFT adapters."""
