"""``python -m trainer`` (and ``torchrun -m trainer``) runs ``weightcast trainer``."""

import sys

from shared.cli import main

if __name__ == "__main__":
    sys.exit(main(["trainer", *sys.argv[1:]]))
