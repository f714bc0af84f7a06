"""Kernels the distribution adds for DeepSeek-V4 on sm_120 (bf16 index-K logits).

Each kernel comes as a torch reference and a Triton kernel with the same arguments.
"""
