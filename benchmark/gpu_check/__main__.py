"""`python -m benchmark.gpu_check`: the GPU proof kit (see the package docstring)."""

import sys

from benchmark.gpu_check.harness import main

sys.exit(main())
