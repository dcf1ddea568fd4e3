"""``python -m weightcast_trainer`` (and ``torchrun -m weightcast_trainer``) runs
``weightcast trainer``."""

import sys

from weightcast.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["trainer", *sys.argv[1:]]))
