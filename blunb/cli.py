"""What the command-line entry points share: the name a user typed to start them."""

import os
import sys


def prog_name(script: str, module: str) -> str:
    """`script` when started as the installed command (blunb-train), else `python -m module`: usage
    lines then show the command the user can retype."""
    return script if os.path.basename(sys.argv[0]) == script else f"python -m {module}"
