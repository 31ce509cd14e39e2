"""Stacks taken before a verdict: what lets two hangs page in seconds, not a minute.

Two hangs look like nothing but a generic stall to the progress signals:

- every local rank waits in the start-up rendezvous (the TCPStore, init_process_group)
  for ranks that belong to other nodes: the local world is complete, so rank counts
  say nothing, and the CPU stall needs 45 s;
- one process whose kernel never completes: its GPU busy with the SMs idle (one
  spinning thread block), its host thread waiting in a CUDA synchronize.

When the detector sees either shape starting (`HangDetector.wants_stacks`), the
monitor takes two py-spy dumps of every rank `stacks_confirm_seconds` apart
(`hangs.stacks` on). `evidence_of` reads them: every rank's main thread in the
rendezvous in both dumps, or every rank's main thread in a synchronize in both.
The detector decides on that evidence only if it was taken after the shape began.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.jobview import Frame, StackCapture

__all__ = ["RENDEZVOUS", "SYNCHRONIZE", "StackEvidence", "StackProbes", "evidence_of"]

# py-spy frame texts ("function (file:line)", or the library for native frames)
RENDEZVOUS = re.compile(
    r"TCPStore::waitForWorkers|TCPStore::wait\b|_store_based_barrier|_env_rendezvous_handler"
    r"|^init_process_group \(|^rendezvous \(torch/distributed/"
)
SYNCHRONIZE = re.compile(
    r"\bcu(?:da)?(?:Stream|Device|Event|Ctx)Synchronize|^synchronize \([^)]*torch/cuda/"
)
RETRY_SECONDS = 30.0  # a job whose stacks showed neither shape is asked again after this


@dataclass(frozen=True, slots=True)
class StackEvidence:
    """What two dumps of every rank of a job showed."""

    job: str
    kind: str  # "rendezvous" | "synchronize" | "" (neither, or not every rank, or no stack)
    first_at: float  # when the first dumps were taken
    at: float  # when the second ones were
    where: str = ""  # the call the ranks wait in ("cudaDeviceSynchronize", ...)
    captures: Mapping[int, StackCapture] = field(default_factory=dict)  # the second dumps


def _main(cap: StackCapture | None) -> tuple[Frame, ...]:
    if cap is None or not cap.ok:
        return ()
    main = cap.main_thread()
    return main.frames if main is not None else ()


def _kind(frames: tuple[Frame, ...]) -> tuple[str, str]:
    """(kind, the outermost frame of that kind) of one main thread, innermost frame first."""
    for kind, pattern in (("rendezvous", RENDEZVOUS), ("synchronize", SYNCHRONIZE)):
        hits = [f for f in frames if pattern.search(f.text())]
        if hits:
            outer = hits[-1]
            name = "torch.cuda.synchronize" if outer.function == "synchronize" else outer.function
            return kind, name
    return "", ""


def evidence_of(
    job: str,
    first: Mapping[int, StackCapture],
    second: Mapping[int, StackCapture],
    first_at: float,
    at: float,
) -> StackEvidence:
    """One kind when every rank's main thread shows it in both dumps, else ''."""
    kinds = {_kind(_main(caps.get(pid))) for pid in first for caps in (first, second)}
    kind, where = next(iter(kinds)) if len(kinds) == 1 and first else ("", "")
    return StackEvidence(job, kind, first_at, at, where, dict(second))


class StackProbes:
    """Which jobs had their stacks asked before a verdict, and what came back.

    The monitor's consumer thread asks (`due`), the forensics thread answers (`put`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict[str, float] = {}
        self._evidence: dict[str, StackEvidence] = {}

    def due(self, wanted: Iterable[str], now: float) -> list[str]:
        """Of the jobs the detector wants stacks of, those not asked lately (now marked)."""
        out = []
        with self._lock:
            for job in wanted:
                asked = self._asked.get(job)
                if asked is not None and now - asked < RETRY_SECONDS:
                    continue  # in flight, or it showed neither shape a moment ago
                self._asked[job] = now
                out.append(job)
        return out

    def put(self, evidence: StackEvidence) -> None:
        with self._lock:
            self._evidence[evidence.job] = evidence

    def evidence(self) -> dict[str, StackEvidence]:
        with self._lock:
            return dict(self._evidence)

    def keep(self, jobs: Iterable[str]) -> None:
        """Forget the jobs not listed (ended): bounded memory."""
        live = set(jobs)
        with self._lock:
            for d in (self._asked, self._evidence):
                for job in [j for j in d if j not in live]:
                    del d[job]
