"""SHA-256 without loading OpenSSL.

`import hashlib` loads `_hashlib`, which maps libcrypto: about 3.5 MiB of
resident memory for a daemon that hashes a few short strings (alert
fingerprints, the remediation spread). CPython's own SHA-256, the module
hashlib itself falls back to, gives the same digests.
"""

from __future__ import annotations

from typing import Any

__all__ = ["sha256"]

_SHA256: Any
try:  # 3.12 and later
    from _sha2 import sha256 as _SHA256  # type: ignore[import-not-found,no-redef,unused-ignore]
except ImportError:
    try:  # 3.11
        from _sha256 import sha256 as _SHA256  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:  # an interpreter built without them: the OpenSSL one
        from hashlib import sha256 as _SHA256  # type: ignore[no-redef,unused-ignore]


def sha256(data: bytes) -> bytes:
    """The SHA-256 digest of `data`."""
    return bytes(_SHA256(data).digest())
