"""`python -m klppo` and `accelerate launch -m klppo`: the `klppo` command (`klppo.cli.command`)."""

import sys

from klppo.cli import command

if __name__ == "__main__":
    sys.exit(command())
