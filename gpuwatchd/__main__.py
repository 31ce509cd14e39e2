"""`python -m gpuwatchd`: the command line."""

import logging
import os
import sys
import threading
import time

from gpuwatchd.cli import main

# How long a finished command waits for its worker threads before it leaves anyway.
EXIT_GRACE_SECONDS = 1.0


def _exit(rc: int) -> None:
    """Exit with `rc`; a thread still blocked in a driver call must not hold the exit.

    The interpreter joins every non-daemon thread at exit, thread-pool workers too
    (concurrent.futures): an NVML call hung on a sick GPU would keep `check` alive
    for the whole call timeout after its verdict was printed (5.3 s with --timeout 2).
    """
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    for t in others:
        if not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in others):
        # pool workers count too, daemon or not: concurrent.futures joins them at exit
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


_exit(main())
