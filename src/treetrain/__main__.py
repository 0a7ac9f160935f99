"""``python -m treetrain``: the same command line as the ``treetrain`` script."""

import sys

from treetrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
