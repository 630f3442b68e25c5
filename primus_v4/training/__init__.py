"""Training loop, loss, optimizer (with host offload), checkpoints, metrics."""
