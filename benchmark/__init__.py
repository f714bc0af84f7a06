"""Benchmarks and load checks for a DeepSeek-V4 deployment (run as `python -m benchmark.<name>`)."""
