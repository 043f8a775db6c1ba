"""Per-key program quotas: each API key's namespace, the live programs it owns, and the
cap on them (``--max-programs-per-key``).

With keys configured (``mori.gateway.auth``) the gateway prefixes the ids of each key's
programs with the key's namespace (``NAMESPACE/id``); without keys every program is in
the namespace ``""``. A program counts against its namespace from its first request until
it ends (released, idle past ``program_ttl_s``, or left behind), and a key at its cap gets
429 for a new program while its live ones go on. The owned sets also give a key's page of
``/v1/programs`` at the cost of its own programs, not every program's.
"""

from __future__ import annotations

from collections.abc import Set

from mori.gateway.held import AdmissionRejected


class KeyQuotas:
    """The live programs of each key namespace, and the cap on them (``limit``; 0: none).
    ``keyed``: keys are configured, so program ids carry a namespace."""

    __slots__ = ("owned", "_keyed", "limit")

    def __init__(self, keyed: bool, limit: int) -> None:
        self.owned: dict[str, set[str]] = {}  # a key's namespace -> its live programs
        self._keyed = keyed
        self.limit = limit

    def owner_of(self, program_id: str) -> str:
        """The key namespace a program belongs to ("" without keys): the prefix the
        gateway gives the ids of each key's programs (``mori.gateway.auth``)."""
        if not self._keyed:
            return ""
        owner, sep, _ = program_id.partition("/")
        return owner if sep else ""

    def check(self, program_id: str, retry_after_s: float) -> None:
        """Raise ``AdmissionRejected`` (429) if ``program_id``, a new program, would take
        its key past the cap."""
        limit = self.limit
        if limit and len(self.owned.get(self.owner_of(program_id), ())) >= limit:
            raise AdmissionRejected(429, f"this key already has {limit} programs, the most "
                                    "allowed (--max-programs-per-key); release finished "
                                    "ones (POST /v1/programs/ID/release) or let idle ones "
                                    "expire", retry_after_s)

    def add(self, program_id: str) -> None:
        """A program began: it counts against its key."""
        self.owned.setdefault(self.owner_of(program_id), set()).add(program_id)

    def discard(self, program_id: str) -> None:
        """A program ended: it no longer counts."""
        owner = self.owner_of(program_id)
        mine = self.owned.get(owner)
        if mine is not None:
            mine.discard(program_id)
            if not mine:
                del self.owned[owner]

    def programs_of(self, owner: str) -> Set[str]:
        """The live programs of the key namespace ``owner``."""
        return self.owned.get(owner, frozenset())
