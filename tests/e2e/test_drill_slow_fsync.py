"""Drill: every fsync takes 3 s; alerts must still reach Alertmanager at once.

The daemon runs with a preloaded shim that makes fsync(2) and fdatasync(2)
sleep while a flag file exists: a slow disk for real, SQLite's own syncs
included. Critical Xids are written to the kernel log one after another;
each must be active in a real Alertmanager within 2 s of its line (before the
fix the alert queue synced on the consumer thread: 3-21 s), and the outbox
must still have been synced (slowly) meanwhile.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess
from tests.e2e.faults import BUS, Drill
from tests.servers import AlertmanagerServer

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static void slow(void) {
    const char *flag = getenv("SLOW_FSYNC_FLAG"), *secs = getenv("SLOW_FSYNC_SECONDS");
    if (!flag || !secs || access(flag, F_OK) != 0) return;
    double s = atof(secs);
    struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}
int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    slow();
    return real(fd);
}
int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    slow();
    return real(fd);
}
"""
SLOW = 3.0
LIMIT = 2.0  # seconds from the kernel line to the alert in Alertmanager


@pytest.fixture(scope="module")
def slow_fsync(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the slow-fsync shim")
    d = tmp_path_factory.mktemp("slowfsync")
    (d / "slowfsync.c").write_text(SHIM)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(d / "slowfsync.so"), str(d / "slowfsync.c")],
        check=True,
        capture_output=True,
    )
    return d / "slowfsync.so"


def test_alerts_go_out_while_every_fsync_takes_three_seconds(
    tmp_path: Path, alertmanager: AlertmanagerServer, slow_fsync: Path
) -> None:
    drill = Drill(tmp_path, alertmanager.url, node="drill-slow-fsync")
    flag = tmp_path / "disk-is-slow"
    d = DaemonProcess(
        tmp_path,
        drill.config_text,
        ["--nvml-replay", str(drill.capture), "--state-dir", str(drill.state_dir)],
        {
            "LD_PRELOAD": str(slow_fsync),
            "SLOW_FSYNC_FLAG": str(flag),
            "SLOW_FSYNC_SECONDS": str(SLOW),
        },
    )
    drill.daemon = d
    try:
        d.notify.wait_for("READY=1", timeout=60)
        flag.touch()
        late: dict[tuple[int, int], float] = {}
        for code, gpu in ((79, 0), (48, 1), (95, 0)):
            drill.feed(code, gpu)
            written = time.monotonic()
            key = (code, f"{BUS[gpu]}.0")

            def arrived(k: tuple[int, str] = key) -> bool:
                return k in drill.in_alertmanager(alertmanager)

            drill.wait_for(arrived, 30, str(key))
            late[(code, gpu)] = time.monotonic() - written
        print(f"seconds from kernel line to Alertmanager, fsync {SLOW} s: {late}")
        assert max(late.values()) < LIMIT, f"seconds from line to Alertmanager: {late}"
        # the outbox was synced meanwhile, and the shim really slowed that
        drill.wait_for(
            lambda: (
                json.loads(d.get("/status")[1])["alerts"]["outbox_slowest_sync_seconds"]
                >= SLOW * 0.9
            ),
            3 * SLOW,
            "a slow sync of the outbox",
        )
    finally:
        flag.unlink(missing_ok=True)
        drill.stop()


STOP_BUDGET = 15.0  # seconds from SIGTERM to exit; systemd's TimeoutStopSec is 30


def test_sigterm_on_a_slow_disk_exits_well_within_the_units_stop_timeout(
    tmp_path: Path, alertmanager: AlertmanagerServer, slow_fsync: Path
) -> None:
    """Every fsync takes 5 s at stop: exit 0 in well under TimeoutStopSec=30 (30.6 s before:
    systemd SIGKILLed it and the next start counted an unclean restart)."""
    drill = Drill(tmp_path, alertmanager.url, node="drill-slow-stop")
    flag = tmp_path / "disk-is-slow"
    d = DaemonProcess(
        tmp_path,
        drill.config_text,
        ["--nvml-replay", str(drill.capture), "--state-dir", str(drill.state_dir)],
        {
            "LD_PRELOAD": str(slow_fsync),
            "SLOW_FSYNC_FLAG": str(flag),
            "SLOW_FSYNC_SECONDS": "5",
        },
    )
    drill.daemon = d
    try:
        d.notify.wait_for("READY=1", timeout=60)
        for code, gpu in ((79, 0), (48, 1)):
            drill.feed(code, gpu)
        drill.assert_nothing_lost(alertmanager)
        flag.touch()
        began = time.monotonic()
        d.proc.terminate()
        rc = d.proc.wait(60)
        took = time.monotonic() - began
        print(f"SIGTERM to exit with 5 s fsyncs: {took:.1f} s")
        assert rc == 0 and took < STOP_BUDGET, f"exit {rc} after {took:.1f} s"
    finally:
        flag.unlink(missing_ok=True)
        drill.stop()
    try:
        again = drill.start()  # the run marker says the stop was clean
        assert drill.metric("gpuwatchd_unclean_restarts_total") == 0, again.output()[-2000:]
        assert drill.stored() == drill.expected_store()  # the stop's log recovered
    finally:
        drill.stop()
