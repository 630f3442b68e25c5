"""Corpus -> tokens -> packs (THD rows) -> node-local cache -> batches."""
