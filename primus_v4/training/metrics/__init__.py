"""Per-step metrics: the writer (metrics.jsonl, log, summary, loss.png), history, trackers."""
