"""The host's rendezvous store: a ``torch.distributed.TCPStore`` that the process groups of every
plan this host's leader makes are built over (``python -m elaswave.runtime.storeserver``).

It is part of the daemon, in a process of its own so that the daemon never imports torch; the
daemon starts it (forked from the worker template, or executed when there is none), reads the
port it bound from ``--report-fd`` and stops it last. It dies with the daemon.
"""

from __future__ import annotations

import argparse
import os
import signal

from elaswave.procutil import die_with_parent, exit_now


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elaswave-store")
    parser.add_argument("--host", required=True, help="the address workers reach the store on")
    parser.add_argument("--report-fd", type=int, required=True, help="the bound port goes here")
    args = parser.parse_args(argv)
    die_with_parent()
    import torch.distributed as dist

    store = dist.TCPStore(args.host, 0, is_master=True, wait_for_workers=False)
    os.write(args.report_fd, f"{store.port}\n".encode())
    os.close(args.report_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the daemon's to handle
    signal.signal(signal.SIGTERM, lambda *_: None)  # ends the pause below: a clean exit
    signal.pause()  # the store serves from its own thread until the daemon stops us
    return 0


if __name__ == "__main__":
    exit_now(main())
