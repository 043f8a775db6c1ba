"""Who may do what: API keys, admin keys and per-key program namespaces.

With API keys configured (``--api-key``), the OpenAI endpoints need ``Authorization:
Bearer KEY``; each key has its own program namespace, so two keys that use the same
``program_id`` drive two programs, and no key can read, release or send to another
key's programs. Inside the gateway (the policy, the engines' KV controls) a program of
a key is ``<tag>/<program_id>``, where the tag is derived from the key by a hash; clients
see their own ids unchanged. Admin keys (``--admin-key``) guard the inspection and
control endpoints over all programs (the list of every program, decisions, residency,
release of any program, and ``/metrics`` unless it is made public); an admin key is
also accepted where an API key is. Keys are compared in constant time (every configured
key is compared, on SHA-256 digests) and are never logged or shown.

Without any key, every endpoint is open and ids are used as sent (a loopback bind; a
non-loopback bind refuses to start without keys unless told it may: ``check_exposure``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mori.protocol.fields import MAX_PROGRAM_ID_BYTES_LIMIT

__all__ = ["Access", "KeyRing", "Principal", "check_exposure", "read_key_file"]

_TAG_HEX = 12
_SEP = "/"


class Access(Enum):
    """What a request's credentials allow."""

    NONE = "none"  # keys are configured and the request has no valid one
    CLIENT = "client"  # an API key: the OpenAI endpoints, its own programs
    ADMIN = "admin"  # an admin key: everything


@dataclass(frozen=True, slots=True)
class Principal:
    """A request's identity: its access and its program namespace (``tag``; "" when the
    gateway runs without keys, so ids are used as sent)."""

    access: Access
    tag: str = ""

    def internal(self, program_id: str) -> str:
        """The gateway's id for this principal's ``program_id``."""
        return f"{self.tag}{_SEP}{program_id}" if self.tag else program_id

    def external(self, internal_id: str) -> str | None:
        """This principal's own id for a gateway id, None if the program is another's."""
        if not self.tag:
            return internal_id
        prefix = self.tag + _SEP
        return internal_id[len(prefix):] if internal_id.startswith(prefix) else None

    def id_limit(self, max_bytes: int) -> int:
        """The longest id (UTF-8 bytes) this principal may send: ``max_bytes``, less what
        the namespace adds where the gateway's id would pass what every engine takes
        (``MAX_PROGRAM_ID_BYTES_LIMIT``)."""
        if not self.tag:
            return max_bytes
        return min(max_bytes, MAX_PROGRAM_ID_BYTES_LIMIT - len(self.tag) - len(_SEP))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyRing:
    """The configured keys, held only as SHA-256 digests."""

    __slots__ = ("_keys",)

    def __init__(self, api_keys: tuple[str, ...] = (), admin_keys: tuple[str, ...] = ()
                 ) -> None:
        for k in (*api_keys, *admin_keys):
            if not k or k != k.strip() or any(c.isspace() for c in k):
                raise ValueError("an API key must be non-empty and contain no whitespace")
        keys: list[tuple[bytes, Access]] = []
        for k in api_keys:
            keys.append((_digest(k), Access.CLIENT))
        for k in admin_keys:
            keys.append((_digest(k), Access.ADMIN))
        self._keys = tuple(keys)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (else every request is an unauthenticated admin)."""
        return bool(self._keys)

    def identify(self, authorization: str | None) -> Principal:
        """The principal of an ``Authorization`` header value."""
        if not self._keys:
            return Principal(Access.ADMIN)
        token = _bearer(authorization)
        if token is None:
            return Principal(Access.NONE)
        d = _digest(token)
        found = Access.NONE
        for kd, access in self._keys:  # every key compared, whatever matches
            if hmac.compare_digest(d, kd):
                found = access
        if found is Access.NONE:
            return Principal(Access.NONE)
        return Principal(found, d.hex()[:_TAG_HEX])


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def read_key_file(path: Path) -> list[str]:
    """Keys from a file: one per line; blank lines and lines starting with ``#`` are
    skipped. ``ValueError`` names the file when it cannot be read or holds no key."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the key file {path}: {e}") from None
    keys = [ln.strip() for ln in text.splitlines()
            if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise ValueError(f"the key file {path} holds no key (one key a line)")
    return keys


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) reaches only this machine."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_exposure(host: str, keys: KeyRing, allow_unauthenticated: bool) -> None:
    """Refuse (``ValueError`` saying what to do) to serve a non-loopback address without
    keys, unless ``allow_unauthenticated``. (Admin keys alone lock every endpoint: the
    OpenAI ones then take an admin key.)"""
    if allow_unauthenticated or keys.enabled or is_loopback(host):
        return
    raise ValueError(
        f"refusing to listen on {host} without API keys: anyone who reaches it could read "
        "and drive every program. Give --api-key KEY (or --api-key-file FILE, or "
        "MORI_API_KEYS), or --allow-unauthenticated if the network is trusted, or "
        "--host 127.0.0.1")
