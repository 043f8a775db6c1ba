"""Who may use the label channel: the shared secret, each message's signature, replay
protection, and which endpoints may run without a secret.

Every message is signed with an HMAC-SHA256 keyed by a secret that the gateway and the
engine share (read from a file, or from the environment). The request travels as two ZMQ
frames, ``[payload, tag]``: ``payload`` is the protocol's JSON object with two more
fields, ``ts`` (the sender's clock, Unix seconds) and ``nonce`` (random, 32 hex digits);
``tag = HMAC(key, REQUEST_CONTEXT + payload)``. The engine checks the tag *before* it
parses the payload (nothing of an unsigned frame is ever decoded), then refuses a ``ts``
more than ``window_s`` from its own clock and a ``nonce`` it has already taken within that
window (:class:`ReplayGuard`): a captured message cannot be played again. A reply is
signed too, bound to the request it answers: ``HMAC(key, REPLY_CONTEXT + request_tag +
payload)``, so a gateway takes residency only from an engine that holds the secret, and
no old reply can pass for a new one.

Why an HMAC and not ZMQ's CURVE: one secret file for both ends (CURVE needs a key pair
per side and a ZAP handler), only the standard library (the plug-in runs inside the
engine's Python), the same scheme over ``tcp://`` and ``ipc://``, and a rotation that
needs no restart (below). What it does not give: confidentiality (label messages and
residency travel in clear: program ids and token counts, no prompt text; run the channel
on a private network or through a tunnel where that matters), and a bound on what libzmq
buffers of one multipart message before the engine reads and refuses it (``MAXMSGSIZE``
bounds each frame, not the number of frames): which is why the default endpoint is
loopback.

The secret file holds one key per line (``#`` comments and blank lines ignored), each at
least :data:`MIN_KEY_CHARS` characters (``openssl rand -hex 32`` makes one). The first
key signs; every key verifies. The file is read again when it changes (checked at most
once a second), so a secret is rotated without a restart: add the new key as a second
line on every engine, make it the first (or only) line on the gateway, then remove the
old one from the engines.

Without a secret, messages go unsigned, and only a loopback or ``ipc://`` endpoint is
allowed (:func:`check_exposure`): anyone who can reach the port could otherwise read
every program the engine holds and drive its eviction.

Standard library only: imported inside the engines.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path

SECRET_FILE_ENV = "MORI_LABEL_SECRET_FILE"
SECRET_ENV = "MORI_LABEL_SECRET"
MIN_KEY_CHARS = 32
TAG_BYTES = 32  # an HMAC-SHA256
REQUEST_CONTEXT = b"mori-label-channel/1 request\n"
REPLY_CONTEXT = b"mori-label-channel/1 reply\n"
WINDOW_S = 30.0  # a message's clock may differ from the engine's by this much
MAX_NONCES = 200_000  # messages remembered within 2 x WINDOW_S (about 3,300 a second)
RELOAD_EVERY_S = 1.0
HOW_TO_MAKE = ("make one with: openssl rand -hex 32 > FILE && chmod 600 FILE")


class SecretError(ValueError):
    """A secret that cannot be used (the text says what is wrong and how to fix it)."""


class ExposureError(ValueError):
    """A label endpoint others could reach, without a secret."""


def _keys_of(text: str, source: str) -> list[bytes]:
    keys = [ln.strip() for ln in text.splitlines()
            if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise SecretError(f"the label secret {source} holds no key ({HOW_TO_MAKE})")
    short = [i + 1 for i, k in enumerate(keys) if len(k) < MIN_KEY_CHARS]
    if short:
        raise SecretError(f"the label secret {source}: key {', '.join(map(str, short))} is "
                          f"shorter than {MIN_KEY_CHARS} characters ({HOW_TO_MAKE})")
    return [k.encode() for k in keys]


class LabelSecret:
    """The keys of the label channel: from a file (read again when it changes) or fixed.

    ``keys()[0]`` signs; any key verifies. Thread-safe (the engine's server thread and its
    callers read it)."""

    def __init__(self, keys: list[bytes], *, path: Path | None = None,
                 source: str = "", logger: logging.Logger | None = None) -> None:
        if not keys:
            raise SecretError(f"the label secret {source} holds no key ({HOW_TO_MAKE})")
        self._keys = list(keys)
        self.path = path
        self.source = source or (str(path) if path else "(given)")
        self.log = logger or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._stamp = self._stat() if path else None
        self._checked = time.monotonic()

    @classmethod
    def from_file(cls, path: str | Path, logger: logging.Logger | None = None
                  ) -> LabelSecret:
        p = Path(path).expanduser()
        source = f"file {p}"
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SecretError(f"cannot read the label secret file {p}: {e} "
                              f"({HOW_TO_MAKE})") from None
        secret = cls(_keys_of(text, source), path=p, source=source, logger=logger)
        secret.warn_if_readable_by_others()
        return secret

    @classmethod
    def from_text(cls, text: str, source: str = f"${SECRET_ENV}") -> LabelSecret:
        return cls(_keys_of(text, source), source=source)

    def _stat(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def warn_if_readable_by_others(self) -> None:
        if self.path is None:
            return
        try:
            mode = self.path.stat().st_mode
        except OSError:
            return
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            self.log.warning("MORI label channel: the secret file %s can be read by other "
                             "users (mode %o): chmod 600 it", self.path, mode & 0o777)

    def keys(self) -> list[bytes]:
        """The keys now (the file read again if it changed since the last look, at most
        once a second; a file that became unreadable or empty keeps the keys it had)."""
        if self.path is None:
            return self._keys
        now = time.monotonic()
        with self._lock:
            if now - self._checked < RELOAD_EVERY_S:
                return self._keys
            self._checked = now
            stamp = self._stat()
            if stamp is None or stamp == self._stamp:
                return self._keys
            self._stamp = stamp
            try:
                keys = _keys_of(self.path.read_text(encoding="utf-8"), self.source)
            except (OSError, UnicodeDecodeError, SecretError) as e:
                self.log.error("MORI label channel: the secret file changed but cannot be "
                               "used (%s); keeping the keys it had", e)
                return self._keys
            if keys != self._keys:
                self.log.info("MORI label channel: secret file %s read again (%d key%s)",
                              self.path, len(keys), "" if len(keys) == 1 else "s")
            self._keys = keys
            return self._keys

    # -- signatures -------------------------------------------------------------------
    def sign_request(self, payload: bytes) -> bytes:
        return _mac(self.keys()[0], REQUEST_CONTEXT, payload)

    def verify_request(self, payload: bytes, tag: bytes) -> bytes | None:
        """The key that signed this request, or None."""
        if len(tag) != TAG_BYTES:
            return None
        for key in self.keys():
            if hmac.compare_digest(_mac(key, REQUEST_CONTEXT, payload), tag):
                return key
        return None

    @staticmethod
    def sign_reply(key: bytes, request_tag: bytes, payload: bytes) -> bytes:
        return _mac(key, REPLY_CONTEXT + request_tag, payload)

    def verify_reply(self, request_tag: bytes, payload: bytes, tag: bytes) -> bool:
        if len(tag) != TAG_BYTES:
            return False
        return any(hmac.compare_digest(_mac(k, REPLY_CONTEXT + request_tag, payload), tag)
                   for k in self.keys())


def _mac(key: bytes, context: bytes, payload: bytes) -> bytes:
    h = hmac.new(key, context, hashlib.sha256)
    h.update(payload)
    return h.digest()


def new_nonce() -> str:
    return secrets.token_hex(16)


def secret_from(file: str | Path | None = None, env: Mapping[str, str] | None = None,
                logger: logging.Logger | None = None) -> LabelSecret | None:
    """The label secret: from ``file`` when given, else ``$MORI_LABEL_SECRET_FILE``, else
    ``$MORI_LABEL_SECRET`` (the keys themselves, one a line); None without any.
    ``SecretError`` when the one named cannot be used."""
    env = os.environ if env is None else env
    if file:
        return LabelSecret.from_file(file, logger)
    if env.get(SECRET_FILE_ENV):
        return LabelSecret.from_file(env[SECRET_FILE_ENV], logger)
    if env.get(SECRET_ENV):
        return LabelSecret.from_text(env[SECRET_ENV])
    return None


class ReplayGuard:
    """Refuses a message whose clock is more than ``window_s`` from ours, or whose nonce
    was taken already. A nonce is remembered ``2 x window_s`` (past any ``ts`` still
    accepted), at most ``max_nonces`` of them: beyond, messages are refused until older
    ones expire (a limit only a sender of thousands of messages a second meets)."""

    def __init__(self, window_s: float = WINDOW_S, max_nonces: int = MAX_NONCES) -> None:
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._seen: set[str] = set()
        self._order: collections.deque[tuple[float, str]] = collections.deque()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, ts: object, nonce: object, now: float | None = None) -> str | None:
        """None when the message is fresh (its nonce is then taken); else why not."""
        now = time.time() if now is None else now
        while self._order and self._order[0][0] < now:
            self._seen.discard(self._order.popleft()[1])
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts != ts:
            return "no 'ts' (the sender's clock) in the signed message"
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 64:
            return "no 'nonce' (16 to 64 characters) in the signed message"
        skew = float(ts) - now
        if abs(skew) > self.window_s:
            return (f"its clock is {skew:+.0f} s from the engine's (at most "
                    f"{self.window_s:g} s allowed): synchronise the clocks (NTP)")
        if nonce in self._seen:
            return "replayed (its nonce was used already)"
        if len(self._seen) >= self.max_nonces:
            return (f"over {self.max_nonces} messages within {2 * self.window_s:g} s: "
                    "refused until older ones expire")
        self._seen.add(nonce)
        self._order.append((now + 2 * self.window_s, nonce))
        return None


class RateLimitedLog:
    """At most one line per ``every_s`` seconds per reason; the lines skipped are counted
    in the next one."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.log = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, reason: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``reason`` was logged within ``every_s``; True when
        logged."""
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.every_s:
            self._skipped[reason] = self._skipped.get(reason, 0) + 1
            return False
        if len(self._last) > 1000:  # reasons are a handful; never let them pile up
            self._last.clear()
            self._skipped.clear()
        self._last[reason] = now
        skipped = self._skipped.pop(reason, 0)
        if skipped:
            msg += " (%d more like it in the last %g s)"
            args = (*args, skipped, self.every_s)
        self.log.warning(msg, *args)
        return True


# -- which endpoints may go without a secret ------------------------------------------
_TCP = re.compile(r"tcp://(?:\[(?P<v6>[^\]]*)\]|(?P<host>[^:/]*)):(?P<port>[^:/]*)")


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (None for another transport)."""
    m = _TCP.fullmatch(endpoint.strip())
    if m is None:
        return None
    return m.group("v6") if m.group("v6") is not None else m.group("host")


def is_local_endpoint(endpoint: str) -> bool:
    """Whether only this machine can reach ``endpoint``: ``ipc://``, ``inproc://``, or TCP
    on a loopback address (``localhost`` included). ``tcp://*``, ``0.0.0.0``, an
    interface name or any other address is not."""
    e = endpoint.strip()
    if e.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint_host(e)
    if host is None:
        return False
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a name: loopback only if every address it resolves to is
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0])).is_loopback
                               for i in infos)


def check_exposure(endpoint: str, secret: LabelSecret | None, *, side: str) -> None:
    """Refuse (``ExposureError`` saying how to fix it) a label endpoint others can reach
    without a secret. ``side``: ``engine`` (it binds the endpoint) or ``gateway``."""
    if secret is not None or is_local_endpoint(endpoint):
        return
    if side == "engine":
        raise ExposureError(
            f"MORI label channel: refusing to bind {endpoint} without a secret: anyone who "
            "reaches it could read every program the engine holds and drive its eviction. "
            "Give the engine a secret file (mori vllm-args --label-secret-file FILE puts it "
            f"in vLLM's --additional-config; or, for either engine, set {SECRET_FILE_ENV}="
            "FILE), the same file to the "
            "gateway (labels=...,label_secret_file=FILE or mori serve --label-secret-file "
            f"FILE); {HOW_TO_MAKE}. Or bind tcp://127.0.0.1:PORT or ipc://PATH")
    raise ExposureError(
        f"label endpoint {endpoint} is not on this machine and no label secret is given: "
        "the engine refuses such a channel without one. Give the engine's secret file "
        "(labels=...,label_secret_file=FILE, or mori serve --label-secret-file FILE, or "
        f"${SECRET_FILE_ENV}); {HOW_TO_MAKE}")
