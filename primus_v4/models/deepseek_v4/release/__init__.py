"""DeepSeek-V4's release format: the state-dict adapter (release names <-> ours), the release
config.json, the base kept as released, and load/save of a release directory."""
