"""DeepSeek-V4's machinery: parallelize (pipeline stage, expert shards), the pipeline stage
module, the CP split of a pack."""
