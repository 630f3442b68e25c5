"""primus_v4: packed (THD) supervised fine-tuning of DeepSeek-V4, from one CPU process to many
nodes."""

__version__ = "0.1.0"
