"""Programs of clients that name no session: told apart by the conversation itself.

Qwen Code, aider, mini-swe-agent, the openai-agents SDK, the plain SDKs and litellm send
nothing that names their session. Each request of theirs re-sends the whole conversation,
so the conversation says which program it continues: a request whose turns, up to the
start of the model's latest answer, are exactly the turns of a known program's last
request, continues that program (the client sent that prompt, got the answer and now sends
it back with the tool results or the user's next turn). Otherwise it starts a new program,
``conv:<hash>`` where the hash is of the conversation's start (system prompt, first user
message, tools), with a random suffix where that id is held by another live conversation.

What is kept per program is not text but one 16-byte digest: a BLAKE2b chain over the
caller's key namespace, the system prompt and each turn in order (``cache_control`` marks
and Gemini ``thoughtSignature``s left out, so a client that moves them does not break the
chain: Gemini CLI signs the model's turns of the current prompt's loop only), taken over the program's
last request. The index maps digest -> program and program -> (digest, last use); a request
costs one pass of hashing over its turns and a dict look-up at each place where an answer
of the model starts. Programs unseen for ``idle_s`` (the gateway's
``--program-idle-timeout``) or past ``max_programs`` (the least recently seen first) are
forgotten; a forgotten conversation that comes back starts a new program.

A program has one request at a time (an agent waits for its answer): a program whose
request is still running (``busy``, from :meth:`ConversationIndex.program` until
:meth:`ConversationIndex.done`) is not continued by another request, which goes to another
program with the same digest or starts a new one. So a request that repeats a program's
last prompt exactly continues it when it is free (a retry) and starts a program of its own
when it is busy (the same conversation run twice at once, as a load generator sends it).

Failure modes (docs/agents.md): two identical conversations are told apart only while
both have a request running; between their requests either may continue either's
program (their contexts are the same up to there, so the KV that serves one serves the
other); a
client that rewrites earlier turns (drops old tool output, summarises) starts a new
program there; a Responses client that sends ``previous_response_id`` and only its new
items starts a new program at each request. The index lives in the process that names the
request: with ``--workers N`` a conversation whose requests reach several processes gets
its first id in each (its start's hash, the same in all), so only conversations with a
shared start that hop between processes are split.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mori.protocol.apis import ApiSpec, conversation_head, conversation_items

DIGEST_BYTES = 16
START_HASH_HEX = 10
"""Hex digits of the conversation start's hash in a program id."""
DEFAULT_MAX_PROGRAMS = 100_000
PREFIX = "conv:"


@dataclass(slots=True)
class _Entry:
    digest: bytes
    used: float


def _canonical(item: Any) -> bytes:
    """A turn as bytes, ``cache_control`` marks and ``thoughtSignature``s left out
    (clients move them)."""
    if isinstance(item, Mapping):
        parts = item.get("parts")  # a Gemini content
        if isinstance(parts, list) and any(
                isinstance(p, Mapping) and "thoughtSignature" in p for p in parts):
            item = {**item, "parts": [
                {k: v for k, v in p.items() if k != "thoughtSignature"}
                if isinstance(p, Mapping) else p for p in parts]}
        content = item.get("content")
        if isinstance(content, list) and any(
                isinstance(b, Mapping) and "cache_control" in b for b in content):
            item = {**item, "content": [
                {k: v for k, v in b.items() if k != "cache_control"}
                if isinstance(b, Mapping) else b for b in content]}
        if "cache_control" in item:
            item = {k: v for k, v in item.items() if k != "cache_control"}
    return json.dumps(item, ensure_ascii=False, separators=(",", ":"),
                      default=str).encode("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class Chain:
    """A request's digests: ``full`` over all its turns, ``starts`` at each place where
    an answer of the model starts (the digest of the turns before it), latest first."""

    full: bytes
    starts: tuple[bytes, ...]


def chain(namespace: str, system: str, items: list[tuple[bool, Any]]) -> Chain:
    """The digests of a conversation (see the module doc)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(namespace.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(system.encode("utf-8", "surrogatepass"))
    starts: list[bytes] = []
    before = False
    for i, (answer, item) in enumerate(items):
        if answer and not before and i > 0:
            starts.append(h.digest())
        h.update(b"\x1e")
        h.update(_canonical(item))
        before = answer
    starts.reverse()
    return Chain(h.digest(), tuple(starts))


def start_hash(spec: ApiSpec, body: Mapping[str, Any]) -> str:
    """A short hash of the conversation's start: system prompt, first user message, tools."""
    h = hashlib.blake2b(digest_size=16)
    h.update(conversation_head(spec, body).encode("utf-8", "surrogatepass"))
    tools = body.get("tools")
    if tools:
        h.update(b"\x00")
        h.update(json.dumps(tools, sort_keys=True, default=str).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:START_HASH_HEX]


class ConversationIndex:
    """Which program a conversation continues (one per gateway process; single-threaded).

    ``idle_s``: a program unseen this long is forgotten (0: only ``max_programs`` bounds
    the index); ``clock``: monotonic seconds (tests pass a fake one)."""

    def __init__(self, idle_s: float = 3600.0, max_programs: int = DEFAULT_MAX_PROGRAMS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self.max_programs = max(1, max_programs)
        self._clock = clock
        self._by_digest: dict[bytes, list[tuple[str, str]]] = {}
        self._programs: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._busy: set[tuple[str, str]] = set()

    def __len__(self) -> int:
        return len(self._programs)

    def program(self, spec: ApiSpec, body: Mapping[str, Any], namespace: str = ""
                ) -> str | None:
        """The program (without the namespace) that ``body`` continues or starts, busy
        until :meth:`done`; None where the body holds no conversation (a completion's
        prompt)."""
        conv = conversation_items(spec, body)
        if conv is None or not conv[1]:
            return None
        system, items = conv
        c = chain(namespace, system, items)
        now = self._clock()
        self._forget_idle(now)
        for digest in (*c.starts, c.full):  # its answers' starts, latest first; a retry
            for key in self._by_digest.get(digest, ()):
                if key not in self._busy:
                    self._move(key, c.full, now)
                    self._busy.add(key)
                    return key[1]
        pid = PREFIX + start_hash(spec, body)
        if (namespace, pid) in self._programs:  # another conversation with this start
            pid = f"{pid}.{secrets.token_hex(4)}"
        key = (namespace, pid)
        self._programs[key] = _Entry(c.full, now)
        self._link(c.full, key)
        self._busy.add(key)
        while len(self._programs) > self.max_programs:
            self._drop_oldest()
        return pid

    def done(self, namespace: str, program: str) -> None:
        """The program's request ended: the next request of its conversation may
        continue it."""
        self._busy.discard((namespace, program))

    def forget(self, namespace: str, program: str) -> None:
        """The program ended: its conversation, if it goes on, starts a new program."""
        key = (namespace, program)
        entry = self._programs.pop(key, None)
        if entry is not None:
            self._unlink(entry.digest, key)

    def _link(self, digest: bytes, key: tuple[str, str]) -> None:
        self._by_digest.setdefault(digest, []).append(key)

    def _unlink(self, digest: bytes, key: tuple[str, str]) -> None:
        keys = self._by_digest.get(digest)
        if keys is not None and key in keys:
            keys.remove(key)
            if not keys:
                del self._by_digest[digest]

    def _move(self, key: tuple[str, str], new: bytes, now: float) -> None:
        entry = self._programs[key]
        if entry.digest != new:
            self._unlink(entry.digest, key)
            entry.digest = new
            self._link(new, key)
        entry.used = now
        self._programs.move_to_end(key)

    def _forget_idle(self, now: float) -> None:
        if self.idle_s <= 0:
            return
        cutoff = now - self.idle_s
        while self._programs:
            entry = next(iter(self._programs.values()))
            if entry.used >= cutoff:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        key, entry = self._programs.popitem(last=False)
        self._unlink(entry.digest, key)
