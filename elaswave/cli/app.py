"""The ``elaswave`` command line: thin commands over library functions, one module each.

Errors a user can cause print one line on stderr and exit non-zero; ``--json`` sits next to every
table.
"""

from __future__ import annotations

import sys

import typer

from elaswave.cli import doctor as doctor_cli
from elaswave.cli import etcd_access, export, fault, launch, report, status

app = typer.Typer(
    name="elaswave",
    help="Elastic-native training: survive crashes in place, inspect, inject faults, report MTTR.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# the order here is the order ``elaswave --help`` lists them in
app.command()(launch.launch)
app.command()(status.status)
app.command("inject-fault")(fault.inject_fault_cmd)
app.command("etcd-access")(etcd_access.etcd_access)
app.command()(report.report)
app.command()(export.export)
doctor_cli.register(app)  # ``elaswave doctor`` and ``elaswave --version``


def main() -> None:
    """The command line; ``launch ... -- ARGS`` gives ARGS to the script whole (the flags and
    the config file before ``--`` are launch's)."""
    argv = sys.argv[1:]
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        launch.SCRIPT_ARGS[:] = argv[cut + 1 :]
        argv = argv[:cut]
    app(args=argv)


if __name__ == "__main__":
    main()
