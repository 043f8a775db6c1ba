"""The adapter's side of an in-engine MORI plug-in: the label channel's handshake, its
health check, and the labels and drops sent over it. A part the engine adapters hold
(``VLLMAdapter``, ``SGLangAdapter``), as a field.

Rules (the same for every engine):

- :meth:`PluginLink.start` handshakes once; then a check every ``check_s`` seconds
  (:meth:`PluginLink.check`) re-handshakes. A plug-in that stops answering (a request or
  a handshake gets no reply within the channel's timeout) is *down*: the adapter's
  ``on_down`` takes the plug-in's capabilities away, and labels are only recorded. One
  that answers again first gets the full table (``replace``), then ``on_up`` gives the
  capabilities back. The first handshake of a new link does not clear the engine's
  labels (a restarted gateway leaves them be; labels recorded before it are sent with
  ``set``). A handshake from another plug-in instance (the engine restarted between two
  checks) is answered with ``replace`` too.
- A refusal (``ok: false``) is the caller's error (``UpstreamError``, the engine stays
  healthy), not a dead channel.
- The label secret (``secret_file``, else ``$MORI_LABEL_SECRET_FILE``, else
  ``$MORI_LABEL_SECRET``; ``mori.plugin_channel.auth``) signs every message; an engine
  that refuses it, or whose replies are not signed with it, is a plug-in that does not
  answer (down), with the reason in the log. Without one, only an endpoint on this
  machine is accepted (``ValueError`` at construction).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mori.engines.base import Residency, UpstreamError
from mori.engines.label_channel import (
    LabelChannel,
    LabelChannelDown,
    LabelChannelError,
    LabelRefused,
)
from mori.plugin_channel.auth import secret_from

log = logging.getLogger(__name__)


def plugin_residency(reply: dict[str, Any]) -> Residency:
    """A ``residency`` reply of the plug-in (``mori.plugin_channel.protocol``) as a
    ``Residency``; ``ValueError`` when it is not one."""
    def tokens(field: str) -> dict[str, int]:
        held = reply.get(field)
        if not isinstance(held, dict) or not all(
                isinstance(p, str) and isinstance(n, int) and not isinstance(n, bool)
                and n >= 0 for p, n in held.items()):
            raise ValueError(f"'{field}' is not an object of program -> tokens")
        return dict(held)
    inactive = reply.get("inactive")
    if not isinstance(inactive, list) or not all(isinstance(p, str) for p in inactive):
        raise ValueError("'inactive' is not a list of program ids")
    return Residency(gpu_tokens=tokens("gpu"), cpu_tokens=tokens("cpu"),
                     ended=frozenset(inactive))


class PluginLink:
    """One engine's label channel and what is known of its plug-in.

    ``name``: the engine as messages name it (``"vLLM http://..."``); ``fallback``: what
    eviction is while the plug-in does not answer (``"plain LRU"``); ``on_up(hello)`` and
    ``on_down()``: the adapter's hooks when the plug-in starts and stops answering;
    ``logger``: where its messages go (the adapter's logger; by default this module's);
    ``secret_file``: the label secret's file (the engine's; see the module's text).
    """

    def __init__(self, endpoint: str, *, timeout_s: float, check_s: float, name: str,
                 fallback: str, on_up: Callable[[dict[str, Any]], None],
                 on_down: Callable[[], None], logger: logging.Logger | None = None,
                 secret_file: str | None = None) -> None:
        if check_s <= 0:
            raise ValueError(f"labels_check_s must be > 0, got {check_s}")
        self.channel = LabelChannel(endpoint, timeout_s,
                                    secret=secret_from(secret_file, logger=logger))
        self.check_s = check_s
        self.name = name
        self.fallback = fallback
        self._on_up = on_up
        self._on_down = on_down
        self.hello: dict[str, Any] | None = None
        """The plug-in's last handshake (None: it has not answered yet)."""
        self.connections = 0  # handshakes that (re)established the channel
        self.up = False  # the plug-in answers: labels are sent, not only recorded
        self.error = ""
        self._checker: asyncio.Task[None] | None = None
        self.log = logger or log

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """The first handshake, then the background check."""
        if self._checker is not None:
            return
        if not await self.handshake():
            self.log.warning("%s: eviction is %s: the MORI plug-in did not answer at %s (%s); "
                        "checking again every %g s", self.name, self.fallback,
                        self.channel.endpoint, self.error, self.check_s)
        else:
            self.log.info("%s: the MORI plug-in at %s answers (version %s): typed eviction on",
                     self.name, self.channel.endpoint, (self.hello or {}).get("plugin_version"))
        self._checker = asyncio.create_task(self._check_loop(), name=f"mori labels {self.name}")

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
            self._checker = None
        await self.channel.close()

    async def handshake(self) -> bool:
        """Handshake; on success send what the engine must know of the table (all of it,
        ``replace``, after an earlier connection; the recorded labels, ``set``, on the
        first), then tell the adapter (``on_up``)."""
        ch = self.channel
        try:
            hello = await ch.hello()
            self.up = True  # labels issued from now on are sent
            if self.connections > 0:
                await ch.replace()
            elif ch.table:
                await ch.set_many(dict(ch.table))
        except LabelChannelError as e:
            self.up = False
            self.error = str(e)
            return False
        self.hello = hello
        self.connections += 1
        self._on_up(hello)
        return True

    def lost(self, why: str) -> None:
        """The plug-in stopped answering: labels are only recorded until it answers."""
        self.error = why
        if self.up:
            self.up = False
            self._on_down()
            self.log.warning("%s: the MORI plug-in stopped answering (%s): eviction falls back "
                        "to %s until it answers again", self.name, why, self.fallback)

    async def check(self) -> bool:
        """One check of the channel (the background task runs it every ``check_s``);
        True when the plug-in answers."""
        ch = self.channel
        if not self.up:
            if not await self.handshake():
                self.log.debug("%s: the MORI plug-in at %s still does not answer (%s)",
                          self.name, ch.endpoint, self.error)
                return False
            self.log.info("%s: the MORI plug-in at %s answers%s: typed eviction on",
                     self.name, ch.endpoint,
                     f"; label table re-sent ({len(ch.table)} programs)"
                     if self.connections > 1 else "")
            return True
        try:
            hello = await ch.hello()
            before, self.hello = self.hello, hello
            # another instance: the engine restarted between two checks and lost its labels
            if before is not None and hello.get("instance") != before.get("instance"):
                self.log.info("%s: the MORI plug-in restarted; re-sending the label table "
                         "(%d programs)", self.name, len(ch.table))
                await ch.replace()
        except LabelChannelError as e:
            self.lost(str(e))
            return False
        return True

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            try:
                await self.check()
            except Exception:  # a check never ends the loop
                self.log.exception("%s: label-channel check failed", self.name)

    @property
    def answers_residency(self) -> bool:
        """Whether the plug-in answers and lists ``residency`` among its operations."""
        ops = (self.hello or {}).get("ops")
        return self.up and isinstance(ops, list) and "residency" in ops

    # -- labels and drops ---------------------------------------------------------------
    async def send(self, request: Awaitable[None]) -> None:
        try:
            await request
        except LabelChannelDown as e:
            self.lost(str(e))
        except LabelRefused as e:
            raise UpstreamError(str(e), unhealthy=False) from None

    async def set_label(self, program_id: str, label: str) -> None:
        """Label the program's KV; while the plug-in does not answer, the label is only
        recorded (it goes with the table when the plug-in answers again)."""
        if not self.up:
            try:
                self.channel.record(program_id, label)
            except LabelRefused as e:
                raise UpstreamError(str(e), unhealthy=False) from None
            return
        await self.send(self.channel.set_label(program_id, label))

    async def drop(self, program_id: str) -> None:
        """Ask the plug-in to let the program's KV go first (or, while it does not
        answer, forget its label: the engine's own order decides)."""
        if not self.up:
            self.channel.forget(program_id)
            return
        await self.send(self.channel.drop(program_id))
