"""``python -m nebula_engine``: the ``nebula-engine`` command line."""

from nebula_engine.cli import main

main()
