"""Record one NCCL RAS answer in text (VERBOSE STATUS) and JSON (STATUS) with the project's client.

    python3 tests/gpu/hang_ras_record.py ADDR OUT_PREFIX

Writes OUT_PREFIX.txt and OUT_PREFIX.json (the answers exactly as received)
and prints the parsed summary, or the error.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gpuwatchd.sources.hangs import ras  # noqa: E402


def main(addr: str, prefix: str) -> int:
    try:
        text = ras.query(addr, fmt="text", verbose=True, timeout=10)
        js = ras.query(addr, fmt="json", timeout=10)
    except ras.RasError as e:
        print(f"RAS {addr}: {e}", flush=True)
        return 1
    with open(prefix + ".txt", "w") as f:
        f.write(text.text)
    with open(prefix + ".json", "w") as f:
        f.write(js.text)
    rep = js.report
    assert rep is not None
    for c in rep.communicators:
        for r in c.ranks:
            print(
                f"RAS {os.path.basename(prefix)}: comm {c.hash} rank {r.rank} pid {r.pid} "
                f"init {r.init_state} err {r.async_error} destroy {r.destroy_flag} "
                f"abort {r.abort_flag} finalize {r.finalize_called} "
                f"counts {dict(r.collective_counts)}",
                flush=True,
            )
    print(
        f"RAS {os.path.basename(prefix)}: {len(rep.communicators)} communicator(s), "
        f"{js.seconds * 1000:.1f} ms, protocol {js.server_protocol}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
