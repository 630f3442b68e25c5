"""DeepSeek-V4.1 model family (the math at the top; the release format in `release/`)."""
