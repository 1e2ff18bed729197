import sys

from tinyvllm.entrypoints.cli import main

sys.exit(main())
