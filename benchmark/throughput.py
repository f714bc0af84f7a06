"""Throughput at concurrency 1 and 32 through upstream's serving benchmark (README: "Throughput").

    python -m benchmark.throughput --base-url http://router:8000 --tokenizer MODEL --json tp.json

The benchmark lives in the package (sglang_dsv4.acceptance.throughput, also `sglang-dsv4
throughput`) because the release gate, which operators run from the image, measures with it.
"""

import sys

from sglang_dsv4.acceptance.throughput import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
