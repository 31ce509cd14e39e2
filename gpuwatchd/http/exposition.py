"""/metrics: what prometheus_client renders for the scrape's Accept and Accept-Encoding.

prometheus_client negotiates (`choose_encoder`: OpenMetrics, or the text
format 0.0.4 / 1.0.0; `gzip_accepted`) and writes the body; this module only
caches. The registry is rendered at most once per snapshot generation and
content type, and gzipped once. The HTTP layer's own counters are rendered
fresh on every scrape and appended: anyone can move them with junk requests,
and that must not cost every scrape a full render. For gzip the compressor
that has taken the cached body is copied and given the fresh tail, so the
reply stays one gzip member (some clients read only the first).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.exposition import (
    CONTENT_TYPE_PLAIN_0_0_4,
    choose_encoder,
    generate_latest,
    gzip_accepted,
)
from prometheus_client.registry import Collector

__all__ = ["Exposition", "MAX_CACHED_FORMATS", "negotiate"]

Encoder = Callable[[Collector], bytes]

# Content types kept per generation: the Accept header may name any version or escaping.
MAX_CACHED_FORMATS = 8
_EOF = b"# EOF\n"
# zlib wbits 16 + 13: a gzip header and trailer, an 8 KiB window; with memLevel 4 the kept
# compressor holds about 46 KiB instead of 262 (an 8-GPU body: 11.9 KB gzipped, not 10.9).
_GZIP_WBITS = 16 + 13
_GZIP_MEM_LEVEL = 4


def negotiate(accept: str) -> tuple[Encoder, str]:
    """prometheus_client's choice of format for `accept`; text 0.0.4 where it cannot choose."""
    try:
        return choose_encoder(accept)
    except (TypeError, ValueError):  # a version it cannot compare, e.g. "version=1.0.x"
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4


@dataclass
class _Rendered:
    body: bytes  # without OpenMetrics' closing "# EOF": the tail brings its own
    gzip: tuple[bytes, zlib._Compress] | None = field(default=None)


class Exposition:
    """The /metrics body and headers of one scrape."""

    def __init__(
        self, registry: Collector, tail: Collector, generation: Callable[[], int] | None
    ) -> None:
        self._registry = registry
        self._tail = tail
        self._generation = generation
        self._gen: int | None = None
        self._cache: dict[str, _Rendered] = {}
        self._lock = threading.Lock()

    def reply(self, accept: str, accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
        """Body and headers (Content-Type, Vary, and Content-Encoding when gzipped)."""
        encoder, ctype = negotiate(accept)
        headers = [("Content-Type", ctype), ("Vary", "Accept, Accept-Encoding")]
        entry = self._rendered(encoder, ctype)
        tail = encoder(self._tail)
        if not gzip_accepted(accept_encoding):
            return entry.body + tail, headers
        if entry.gzip is None:
            compressor = zlib.compressobj(wbits=_GZIP_WBITS, memLevel=_GZIP_MEM_LEVEL)
            entry.gzip = (compressor.compress(entry.body), compressor)
        prefix, compressor = entry.gzip
        rest = compressor.copy()  # the cached one stays positioned after the body
        return prefix + rest.compress(tail) + rest.flush(), [
            *headers,
            ("Content-Encoding", "gzip"),
        ]

    def _rendered(self, encoder: Encoder, ctype: str) -> _Rendered:
        gen = self._generation() if self._generation else None
        with self._lock:
            if gen is not None and gen == self._gen and ctype in self._cache:
                return self._cache[ctype]
        body = encoder(self._registry)
        entry = _Rendered(body.removesuffix(_EOF) if body.endswith(_EOF) else body)
        if gen is None:
            return entry
        with self._lock:
            if self._gen is not None and gen < self._gen:
                return entry  # a newer snapshot was cached while this one rendered
            if gen != self._gen:
                self._gen, self._cache = gen, {}
            if len(self._cache) >= MAX_CACHED_FORMATS:
                self._cache.pop(next(iter(self._cache)))
            return self._cache.setdefault(ctype, entry)
