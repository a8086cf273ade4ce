"""``python -m hvdcomp info``: see hvdcomp.cli."""
import sys

from .cli import main

sys.exit(main())
