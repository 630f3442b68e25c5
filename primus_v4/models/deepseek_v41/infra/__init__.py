"""DeepSeek-V4.1's machinery: parallelize (pipeline stage, expert shards), the pipeline stage
module with the shared compressed cache crossing stage boundaries, the CP split of a pack."""
