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
Open to local programs, it must not be open to every web page a local browser shows, so
without keys a request is also refused (403) when its ``Host`` is not a loopback name or
address, the gateway's own address or a name allowed by ``--allowed-host`` (a page whose
name the attacker re-points at 127.0.0.1, DNS rebinding, sends its own name), or when it
carries an ``Origin`` that is not a loopback one, the gateway's own (its address, a
name it answers to, its ``Host``) or one allowed by ``--cors-origin`` (another site's
page posting to the gateway: cross-site request forgery); ``BrowserPolicy``. Clients that are not browsers send no ``Origin``. With keys,
a browser does not send them cross-site on its own, so neither check applies. CORS is off
unless ``--cors-origin`` names origins: those get their preflights answered and
``Access-Control-Allow-Origin`` on every answer.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mori.protocol.errors import clip
from mori.protocol.fields import MAX_PROGRAM_ID_BYTES_LIMIT

__all__ = ["Access", "BrowserPolicy", "KeyRing", "Principal", "check_exposure",
           "normalize_origin", "read_key_file"]

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


# -- browsers: Host and Origin checks, CORS ----------------------------------------------------
_LOOPBACK_NAMES = frozenset(("localhost", "localhost.localdomain"))
_DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def host_name(authority: str) -> str:
    """The host of a ``Host`` value or an origin's ``host[:port]``: lower case, without
    its port, brackets or trailing dot (``[::1]:8000`` -> ``::1``)."""
    v = authority.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        v = v[1:end] if end > 0 else v[1:]
    elif v.count(":") == 1:  # host:port (a bare IPv6 address has more colons)
        v = v.partition(":")[0]
    return v.rstrip(".")


def is_loopback_name(name: str) -> bool:
    """Whether ``name`` (a ``host_name``) is a loopback name or address; decided without
    DNS, whose answers a rebinding attacker controls."""
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _origin_authority(origin: str) -> tuple[str, str] | None:
    """(scheme, host[:port]) of a serialised origin, lower case and without a default
    port; None for anything else (``null``, a path, another scheme)."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    rest = rest.rstrip("/")
    if not sep or scheme not in _DEFAULT_PORTS or not rest or any(c in rest for c in "/@?#"):
        return None
    return scheme, rest.removesuffix(_DEFAULT_PORTS[scheme])


def normalize_origin(origin: str) -> str:
    """A configured origin as browsers send it (``scheme://host[:port]``, lower case, no
    default port or trailing slash), or ``*``; ``ValueError`` saying what is expected."""
    if origin.strip() == "*":
        return "*"
    parts = _origin_authority(origin)
    if parts is None:
        raise ValueError(f"{origin!r} is not an origin: expected scheme://host[:port], e.g. "
                         "http://localhost:3000 (no path), or *")
    return f"{parts[0]}://{parts[1]}"


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """What the gateway lets browsers do (the module doc): ``checked``, the Host and
    Origin checks apply (no keys are configured); ``cors``, the origins CORS is answered
    for (normalised; ``*``: any); ``hosts``, names allowed besides the loopback ones
    (``*``: any)."""

    checked: bool
    cors: frozenset[str] = frozenset()
    hosts: frozenset[str] = frozenset()

    @staticmethod
    def of(keys: KeyRing, cors_origins: tuple[str, ...] = (),
           allowed_hosts: tuple[str, ...] = ()) -> BrowserPolicy:
        return BrowserPolicy(not keys.enabled,
                             frozenset(normalize_origin(o) for o in cors_origins),
                             frozenset("*" if h.strip() == "*" else host_name(h)
                                       for h in allowed_hosts))

    @property
    def active(self) -> bool:
        """Whether any request may be refused or given CORS headers."""
        return self.checked or bool(self.cors)

    def cors_allows(self, origin: str) -> bool:
        """Whether ``origin`` (an ``Origin`` value) is one CORS is answered for."""
        if not self.cors:
            return False
        if "*" in self.cors:
            return True
        parts = _origin_authority(origin)
        return parts is not None and f"{parts[0]}://{parts[1]}" in self.cors

    def refusal(self, host: str | None, origin: str | None, local: str | None
                ) -> tuple[str, str] | None:
        """Why a request with these ``Host`` and ``Origin`` values (None: not sent),
        which came in on the local address ``local``, is refused: (code, message); None
        when it may go on."""
        if not self.checked:
            return None
        local = host_name(local) if local else None
        if host is not None and not self._host_ok(host_name(host), local):
            return "host_not_allowed", (
                f"the Host {clip(host)!r} is not one this gateway answers to without API "
                "keys: only localhost, 127.0.0.1, [::1] and its own address (a guard "
                "against DNS rebinding); to serve it under that name, start it with "
                f"--allowed-host {clip(host_name(host))}, or set API keys (--api-key)")
        if origin is not None and not self._origin_ok(origin, host, local):
            return "origin_not_allowed", (
                f"a request from the web origin {clip(origin)!r} is refused: without API "
                "keys the gateway takes browser requests only from its own pages and "
                "loopback origins such as http://localhost:PORT (a guard against "
                "cross-site request forgery); to let that origin in, start it with "
                f"--cors-origin {clip(origin)}, or set API keys (--api-key)")
        return None

    def _host_ok(self, name: str, local: str | None) -> bool:
        return (name == local or is_loopback_name(name) or name in self.hosts
                or "*" in self.hosts)

    def _origin_ok(self, origin: str, host: str | None, local: str | None) -> bool:
        if self.cors_allows(origin):
            return True
        parts = _origin_authority(origin)
        if parts is None:  # "null" (a sandboxed page, a file) and the like
            return False
        name = host_name(parts[1])
        if name == local or is_loopback_name(name) or name in self.hosts:
            return True  # loopback, the gateway's address, or a name it answers to
        # the gateway's own page, under a Host that passed its check
        return host is not None and parts[1] == host.strip().lower().rstrip(".")
