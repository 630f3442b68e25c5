"""DeepSeek-V4.1's released checkpoint format: names, config.json, load and export."""
