"""The ``elaswave`` console script.

``elaswave launch`` starts this host's worker template (:mod:`elaswave.runtime.template`) before
anything else, even before the command line is parsed: the template's imports (torch, seconds)
then run while the command line, etcd and the daemon start. A launch that ends before it needs
the template (a bad flag, say) takes it down with it.
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["launch"] and not {"--help", "-h"} & set(argv):
        from elaswave.daemon.template import prestart
        from elaswave.daemon.workers import base_environment

        prestart(base_environment())
    from elaswave.cli.app import main as run

    run()


if __name__ == "__main__":
    main()
