"""``--state FILE``: the programs' idleness histories, kept across a gateway restart.

The engines tell a restarted gateway where each program's KV is (``Controller.restore``);
they cannot tell how idle each program was. With ``--state``, the gateway writes every
program's idleness history (``mori.core.idleness.IdlenessHistory``: the completed cycles
of its window and the tool call in progress) to ``FILE`` every ``state_interval_s`` and
when it stops, and reads it back at start: a program found on an engine then keeps its
rank. The time the gateway was down counts as tool time of a program that was in a tool
call.

The file is JSON, written whole to a temporary file beside it and renamed over it (an
atomic replace), so a crash leaves the last whole snapshot. The temporary file has a
random name and is created exclusively, never through a symbolic link, so a link planted
in the folder cannot make the gateway write elsewhere; renaming over ``FILE`` replaces a
link there rather than writing to its target. One that cannot be read (torn,
not JSON, another format or version) is ignored with a warning naming the file and the
fault: programs then start with no history, as without ``--state``.

Only programs the engines still hold are restored; the histories of others are not kept
beyond the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mori.core.idleness import IdlenessHistory

log = logging.getLogger("mori.gateway")

FORMAT = "mori-gateway-state"
VERSION = 1


class StateError(ValueError):
    """A state file that cannot be used; the text names the file and the fault."""


@dataclass(frozen=True, slots=True)
class SavedState:
    """A state file's content: when it was written (Unix seconds) and the histories."""

    written_at: float
    histories: dict[str, IdlenessHistory]

    def aged(self, now_epoch: float, time_scale: float = 1.0) -> dict[str, IdlenessHistory]:
        """The histories as of ``now_epoch``: a tool call in progress went on while the
        gateway was down (``time_scale``: policy seconds per wall second)."""
        gap = max(0.0, now_epoch - self.written_at) * time_scale
        return {pid: h.later(gap) for pid, h in self.histories.items()}


def check_state_path(path: str | os.PathLike[str]) -> None:
    """``StateError`` unless the gateway can write ``path`` (its folder exists and is
    writable; the file, if there, is a file). Nothing is written."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise StateError(f"{p}: not a file")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise StateError(f"{p}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise StateError(f"{p}: the folder {folder} is not writable")


def encode(histories: Iterable[tuple[str, IdlenessHistory]], written_at: float) -> bytes:
    programs = {pid: [[list(c) for c in h.cycles], h.reasoning_s, h.acting_s]
                for pid, h in histories}
    return json.dumps({"format": FORMAT, "version": VERSION, "written_at": written_at,
                       "programs": programs}, separators=(",", ":")).encode()


def write_state(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically: a temporary file beside it, with a random
    name, created exclusively and never through a symbolic link (``O_CREAT | O_EXCL |
    O_NOFOLLOW``, mode 0600), flushed to disk, renamed over it. A link planted at any
    name the gateway might use is not followed: its target is never written."""
    p = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600)
            break
        except FileExistsError:  # taken (planted, or a coincidence): another name
            continue
    else:  # pragma: no cover - 100 random names all taken
        raise FileExistsError(f"{p}: no free temporary name beside it")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_state(path: str | os.PathLike[str]) -> SavedState:
    """The state in ``path``; ``FileNotFoundError`` when there is none, ``StateError``
    naming the file and the fault when it cannot be used."""
    p = Path(path)
    raw = p.read_bytes()
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise StateError(f"{p}: not JSON, torn or not a state file ({e})") from None
    except RecursionError:
        raise StateError(f"{p}: nested too deeply to be a state file") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise StateError(f"{p}: not a MORI gateway state file (no \"format\": \"{FORMAT}\")")
    if obj.get("version") != VERSION:
        raise StateError(f"{p}: state version {obj.get('version')!r}; this gateway reads "
                         f"version {VERSION}")
    written_at = obj.get("written_at")
    programs = obj.get("programs")
    if not isinstance(written_at, int | float) or not isinstance(programs, dict):
        raise StateError(f"{p}: 'written_at' (a number) and 'programs' (an object) are "
                         "required")
    out: dict[str, IdlenessHistory] = {}
    for pid, entry in programs.items():
        try:
            out[pid] = _history(entry)
        except (TypeError, ValueError) as e:
            raise StateError(f"{p}: program {pid[:80]!r}: {e}") from None
    return SavedState(float(written_at), out)


def _history(entry: Any) -> IdlenessHistory:
    if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], list):
        raise ValueError("an entry is [cycles, reasoning_s, acting_s]")
    if not all(isinstance(c, list) and len(c) == 2 for c in entry[0]):
        raise ValueError("a cycle is [reasoning_s, acting_s]")
    cycles = tuple((float(r), float(a)) for r, a in entry[0])
    return IdlenessHistory(cycles, float(entry[1]), float(entry[2]))


def load_state(path: str | os.PathLike[str]) -> SavedState | None:
    """``read_state``, with what a starting gateway does about a missing or unusable
    file: None, said in the log."""
    try:
        state = read_state(path)
    except FileNotFoundError:
        log.info("--state %s: no state file yet; programs start with no idleness history",
                 path)
        return None
    except (StateError, OSError) as e:
        log.warning("--state: ignored (%s); programs start with no idleness history", e)
        return None
    log.info("--state %s: idleness histories of %d program(s), written %.0f s ago", path,
             len(state.histories), max(0.0, time.time() - state.written_at))
    return state


class StateKeeper:
    """Writes the histories to the state file every ``interval_s`` and at ``stop``.

    ``histories`` is called on the event loop (it reads the policy); the encoding and the
    write run in a thread, so a large table does not stall the loop for the disk."""

    def __init__(self, path: str | os.PathLike[str], interval_s: float,
                 histories: Callable[[], list[tuple[str, IdlenessHistory]]]) -> None:
        if not interval_s > 0:
            raise ValueError(f"the state interval must be > 0 s, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self._histories = histories
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        self._failing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="mori state")

    async def stop(self) -> None:
        """Stop writing, after one last snapshot."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.save()

    async def save(self) -> bool:
        """One snapshot now; False (logged once until it works again) when it failed."""
        try:
            data = await asyncio.to_thread(encode, self._histories(), time.time())
            await asyncio.to_thread(write_state, self.path, data)
        except Exception as e:
            if not self._failing:
                log.warning("--state: cannot write %s (%s); will retry every %g s",
                            self.path, e, self.interval_s)
            self._failing = True
            return False
        if self._failing:
            log.info("--state: %s written again", self.path)
        self._failing = False
        self.writes += 1
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.save()
