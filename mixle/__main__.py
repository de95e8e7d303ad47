"""``python -m mixle``: the command line (see ``mixle.lm.cli``)."""

import sys

from mixle.lm.cli import main

if __name__ == "__main__":
    sys.exit(main())
