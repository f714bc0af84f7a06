import sys

from sglang_dsv4.cli import main

sys.exit(main())
