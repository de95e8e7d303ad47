"""``python -m mixle``: the command line (see ``mixle.cli``)."""

import sys

from mixle.cli import main

if __name__ == "__main__":
    sys.exit(main())
