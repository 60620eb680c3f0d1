"""The ``nebula-engine`` command line, above every other part of the package.

``group`` is the command group (``main``, the console script); each other module is one subcommand of the same
name, imported only when that command runs, so ``--help`` stays light; ``options`` holds the parameter types the
commands share. These modules may import any unit of the package; no unit imports them.
"""

from nebula_engine.cli.group import COMMANDS, load_command, main

__all__ = ["COMMANDS", "load_command", "main"]
