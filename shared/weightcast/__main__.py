"""``python -m weightcast`` runs the ``weightcast`` command."""

import sys

from weightcast.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
