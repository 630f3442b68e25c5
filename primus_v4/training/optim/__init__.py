"""Sharded AdamW (ZeRO-1 over the data-parallel replicas), its state, the lr schedule."""
