"""Training checkpoints: DCP save/load, integrity (manifest, verify), the run's lifecycle."""
