"""``python -m elaswave``: the ``elaswave`` command (as the console script runs it)."""

from elaswave.cli.entry import main

main()
