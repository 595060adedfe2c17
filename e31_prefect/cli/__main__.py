"""``python -m e31_prefect.cli``: the ``e31`` command, as it ran when the CLI was one module."""

import sys

from e31_prefect.cli import main

if __name__ == "__main__":
    sys.exit(main())
