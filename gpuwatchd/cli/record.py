"""`gpuwatchd record`: capture what NVML answers on this machine, for the replay backend."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpuwatchd.cli.command import EX_USAGE, Parser
from gpuwatchd.errors import NvmlError
from gpuwatchd.sources.nvml.client import NvmlClient, Pynvml
from gpuwatchd.sources.nvml.record import record
from gpuwatchd.sources.nvml.replay import ReplayClient

if TYPE_CHECKING:
    from gpuwatchd.app import CommandContext

__all__ = ["main", "register"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="FILE", help="capture file to write")
    parser.add_argument("--polls", type=int, default=3, help="polls to record (default 3)")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between polls (default 1)"
    )
    parser.add_argument(
        "--call-timeout", type=float, default=5.0, help="NVML call deadline in seconds (default 5)"
    )
    parser.add_argument(
        "--nvml-replay",
        metavar="FILE",
        help="record a replayed capture instead of real NVML (for testing)",
    )
    # the spelling before 0.2, kept so scripts that use it keep working
    parser.add_argument("--from-replay", dest="nvml_replay", help=argparse.SUPPRESS)


def _flag_problem(args: argparse.Namespace) -> str:
    """What is wrong with the numeric flags ("" when nothing)."""
    if args.polls < 1:
        return f"--polls: must be at least 1 (got {args.polls})"
    if not args.interval >= 0:
        return f"--interval: must be >= 0 seconds (got {args.interval:g})"
    if not args.call_timeout > 0:
        return f"--call-timeout: must be > 0 seconds (got {args.call_timeout:g})"
    return ""


def _nvml_missing(client: NvmlClient, timeout: float) -> str:
    """Why NVML cannot be initialised ("" when it can), within `timeout` seconds."""
    answer: list[str] = []

    def probe() -> None:
        try:
            client.init()
        except NvmlError as exc:
            answer.append(exc.code if str(exc) == exc.code else f"{exc.code} ({exc})")
            return
        except Exception as exc:  # anything else is as fatal for a recording
            answer.append(f"{type(exc).__name__}: {exc}")
            return
        try:
            client.shutdown()
        except NvmlError:
            pass
        answer.append("")

    worker = threading.Thread(target=probe, name="nvml-probe", daemon=True)
    worker.start()
    worker.join(timeout)
    return answer[0] if answer else f"nvmlInit did not return within {timeout:g}s"


def _handle(ctx: CommandContext) -> int:
    args: Any = ctx.args
    problem = _flag_problem(args)
    if problem:
        print(f"gpuwatchd record: {problem}", file=sys.stderr)
        return EX_USAGE
    client: NvmlClient = Pynvml()
    if args.nvml_replay:
        try:
            client = ReplayClient.load(args.nvml_replay)
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            print(f"gpuwatchd record: --nvml-replay {args.nvml_replay}: {why}", file=sys.stderr)
            return 78
    missing = _nvml_missing(client, args.call_timeout)
    if missing:
        # a capture of nothing would only mislead a test that replays it
        print(
            f"gpuwatchd record: NVML is not usable here: {missing}; nothing written",
            file=sys.stderr,
        )
        return 1
    try:
        capture = record(
            args.out,
            polls=args.polls,
            interval=args.interval,
            call_timeout=args.call_timeout,
            client=client,
        )
    except OSError as exc:
        print(f"gpuwatchd record: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 73  # EX_CANTCREAT
    summary = capture["summary"]
    gpus = summary["gpus"]
    print(
        f"wrote {args.out}: {len(gpus)} GPU(s), driver {summary['driver_version']}, "
        f"{capture['polls']} poll(s)"
    )
    if summary["init_error"]:
        print(f"NVML initialisation failed: {summary['init_error']}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: Any) -> None:
    """Add `gpuwatchd record` to the CLI."""
    parser = subparsers.add_parser("record", help="record NVML answers for the replay backend")
    _add_arguments(parser)
    parser.set_defaults(func=_handle)


def main(argv: Sequence[str] | None = None) -> int:
    """`gpuwatchd record` on its own (tests and scripts)."""
    parser = Parser(
        prog="gpuwatchd record", description="Record NVML answers for the replay backend."
    )
    _add_arguments(parser)
    parser.set_defaults(func=_handle)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from gpuwatchd.cli.command import dispatch

    return dispatch(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
