"""sglang-dsv4-sm120: DeepSeek-V4 on Blackwell workstation GPUs, as fixes on a pinned SGLang.

The fixes live in :mod:`sglang_dsv4.fixes` (one module each, in register order); upstream's
plugin loader runs :func:`sglang_dsv4.plugin.load` in every SGLang process.
"""

__version__ = "0.1.0"

# The one upstream release the fixes were written and tested against.
UPSTREAM_PIN = "0.5.23"
