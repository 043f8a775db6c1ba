"""Whole SSE lines out of a byte stream that arrives in pieces, in time linear in the bytes.

An engine's stream reaches the gateway in transport-sized chunks that cut lines anywhere.
``LineBuffer.feed`` returns, for each chunk, the bytes up to its last line end (whole
lines: ready to pass on and to read), as pieces, and holds the rest, the start of a line
whose end has not come yet. A held line is kept as the pieces it came in and given back
as those pieces when its end arrives, never joined here, so a line of n bytes costs
O(n) however many chunks it comes in (joining the held bytes to each new chunk costs
O(n²): 54 s of CPU for one 80 MiB line), and a long line can be passed on piece by
piece. A line longer
than ``max_line`` bytes raises ``LineTooLong``: what is held stays within the cap,
whatever the engine sends.

A stream whose chunks end at line ends (the usual case: engines flush whole events) is
passed on as it came, without a copy.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_SSE_LINE_BYTES", "LineBuffer", "LineTooLong"]

DEFAULT_MAX_SSE_LINE_BYTES = 8 * 1024 * 1024
"""The longest SSE line (bytes, its line end not counted) the gateway takes from an
engine by default (``--max-sse-line-bytes``): far above any real event (a tool call's
arguments, a long text delta), far below what would strain the gateway."""


class LineTooLong(ValueError):
    """A line passed the cap: ``size`` bytes seen so far (at least), ``limit`` the cap."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"an SSE line of over {limit} bytes ({size} bytes and no line end "
                         "yet): beyond --max-sse-line-bytes")
        self.size = size
        self.limit = limit


class LineBuffer:
    """Splits a byte stream at its last line end per chunk (module doc). ``max_line``:
    the longest line taken, in bytes (its ``\\n`` not counted; at least 1)."""

    __slots__ = ("max_line", "_held", "_held_bytes")

    def __init__(self, max_line: int = DEFAULT_MAX_SSE_LINE_BYTES) -> None:
        if max_line < 1:
            raise ValueError(f"max_line must be >= 1 (got {max_line})")
        self.max_line = max_line
        self._held: list[bytes] = []
        self._held_bytes = 0

    @property
    def held(self) -> int:
        """Bytes held: the start of a line whose end has not come."""
        return self._held_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        """The whole lines ``chunk`` completes, as pieces: what was held before them (the
        start of the first line), then ``chunk`` up to its last line end ([] if it
        completes none; ``[chunk]`` itself when nothing was held and it ends a line). The
        rest is held. ``LineTooLong`` if a line passes the cap."""
        end = chunk.rfind(b"\n")
        if end < 0:
            if chunk:
                self._held_bytes += len(chunk)
                if self._held_bytes > self.max_line:
                    raise LineTooLong(self._held_bytes, self.max_line)
                self._held.append(chunk)
            return []
        first = chunk.find(b"\n")
        if self._held_bytes + first > self.max_line:
            raise LineTooLong(self._held_bytes + first, self.max_line)
        if end - first - 1 > self.max_line:  # lines between: only then can one be too long
            self._check_between(chunk, first + 1, end)
        rest = len(chunk) - end - 1
        if rest > self.max_line:
            raise LineTooLong(rest, self.max_line)
        out = self._held
        out.append(chunk if rest == 0 else chunk[:end + 1])
        self._held = []
        self._held_bytes = rest
        if rest:
            self._held.append(chunk[end + 1:])
        return out

    def _check_between(self, chunk: bytes, start: int, end: int) -> None:
        """``LineTooLong`` if a line within ``chunk[start:end]`` (which ends at ``end``)
        passes the cap."""
        while start <= end:
            nl = chunk.find(b"\n", start, end + 1)
            if nl - start > self.max_line:
                raise LineTooLong(nl - start, self.max_line)
            start = nl + 1

    def rest(self) -> bytes:
        """What is held (a last line with no line end), given up: the buffer is empty
        after."""
        out = b"".join(self._held)
        self._held.clear()
        self._held_bytes = 0
        return out
