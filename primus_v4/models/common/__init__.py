"""What every model family reuses: selective recompute, LoRA adapters, the kept release base."""
