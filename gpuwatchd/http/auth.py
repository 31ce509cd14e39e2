"""HTTP basic auth against the web config's bcrypt hashes, split into a fast and a slow half.

bcrypt is slow on purpose (tens to hundreds of ms). `cached()` answers on the
event loop from verdicts already reached (an HMAC, microseconds); `verify()`
runs bcrypt and belongs on the one serialized credentials thread, so a flood
of wrong passwords queues behind itself and never in front of a scrape whose
credentials are already known. Verdicts are cached under a keyed hash, never
the password. Right credentials have their own small cache that wrong ones
cannot evict: only someone holding a password can add to it. An unknown user
is checked against a dummy hash at the highest cost any user has, so the
answer's timing does not say which users exist.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import threading
from collections.abc import Mapping

__all__ = ["Credentials", "bcrypt_cost"]

_MAX_FAILED = 256  # wrong credentials remembered (repeats answered without bcrypt)
_MAX_VERIFIED = 64  # right credentials remembered; only a password holder adds one


def bcrypt_cost(hashed: bytes) -> int:
    """The cost (log2 rounds) of a `$2y$NN$...` hash; 0 if unreadable."""
    digits = hashed[4:6]
    return int(digits) if digits.isdigit() else 0


class Credentials:
    """Basic-auth verdicts for one daemon: `cached()` on the loop, `verify()` on one thread."""

    def __init__(self) -> None:
        self._key = os.urandom(32)
        self._failed: dict[bytes, None] = {}
        self._verified: dict[bytes, None] = {}
        self._lock = threading.Lock()
        self._dummies: dict[int, bytes] = {}  # cost -> a hash of a random password

    def cached(self, users: Mapping[str, bytes], header: str) -> bool | None:
        """True or False if already known (or malformed), None if bcrypt must decide."""
        key = self._digest(users, header)
        if key is None:
            return False
        with self._lock:
            if key in self._verified:
                return True
            if key in self._failed:
                return False
        return None

    def verify(self, users: Mapping[str, bytes], header: str) -> bool:
        """The verdict, by bcrypt when not cached; remembered either way."""
        known = self.cached(users, header)
        if known is not None:
            return known
        key = self._digest(users, header)
        parts = _decode(header)
        assert key is not None and parts is not None
        user, password = parts
        hashed = users.get(user)
        cost = max((bcrypt_cost(h) for h in users.values()), default=10)
        ok = _bcrypt_check(password, hashed or self._dummy(cost)) and hashed is not None
        with self._lock:
            cache = self._verified if ok else self._failed
            if len(cache) >= (_MAX_VERIFIED if ok else _MAX_FAILED):
                cache.pop(next(iter(cache)))
            cache[key] = None
        return ok

    def _digest(self, users: Mapping[str, bytes], header: str) -> bytes | None:
        parts = _decode(header)
        if parts is None:
            return None
        user, password = parts
        hashed = users.get(user, b"")
        return hmac.new(self._key, b"\0".join([user.encode(), password, hashed]),
                        hashlib.sha256).digest()  # fmt: skip

    def _dummy(self, cost: int) -> bytes:
        dummy = self._dummies.get(cost)
        if dummy is None:
            import bcrypt

            dummy = bcrypt.hashpw(os.urandom(16), bcrypt.gensalt(max(4, min(31, cost))))
            self._dummies[cost] = dummy
        return dummy


def _decode(header: str) -> tuple[str, bytes] | None:
    """(user, password) from a Basic Authorization header, or None."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password.encode()) if sep else None


def _bcrypt_check(password: bytes, hashed: bytes) -> bool:
    import bcrypt

    try:
        return bool(bcrypt.checkpw(password, hashed))
    except ValueError:  # over 72 bytes, or a malformed hash
        return False
