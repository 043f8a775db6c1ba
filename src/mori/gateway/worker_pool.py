"""Several gateway processes, one policy: the policy process's side.

With ``mori serve --workers N``, the policy process (the controller, the engines' KV
controls, the inspection endpoints) accepts the connections on the gateway's port,
serves the first itself and hands the others to ``N - 1`` worker processes
(``mori.gateway.worker_process``; ``mori.gateway.handoff`` deals them out). A worker parses,
checks keys and forwards to the engines itself; for admission it asks the policy process
over a local socket (``mori.gateway.ipc``) and reports the lease's events back, so the
policy sees every arrival, KV-ready and step end as it would in one process.
``WorkerHub`` serves those requests with the local ``Controller`` and keeps the workers'
list of served models the policy process's own (sent at ``hello`` and on every change,
refreshed on a worker's asking), so a model name maps alike in every process;
``spawn_worker`` starts a process.

A worker that goes away has its admissions cancelled and its leases finished (context
unchanged), so no program is left Reasoning; ``keep_workers`` starts it again (new
connections go to the others meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mori.engines.base import UpstreamError
from mori.gateway.agents import RequestFacts, StepFacts
from mori.gateway.held import AdmissionRejected
from mori.gateway.ipc import FrameWriter, frame_limit, read_frame
from mori.gateway.lease import RequestLease
from mori.gateway.metrics import WORKER_TALLIES

if TYPE_CHECKING:
    from mori.gateway.app import Gateway

log = logging.getLogger("mori.gateway")


@dataclass(eq=False)
class _Peer:
    writer: asyncio.StreamWriter
    limit: int
    worker: str = "?"
    admitting: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    leases: dict[int, RequestLease] = field(default_factory=dict)
    out: FrameWriter | None = None

    def send(self, msg: dict[str, Any]) -> None:
        if self.out is None:
            self.out = FrameWriter(self.writer, self.limit)
        self.out.write(msg)


class WorkerHub:
    """Serves the workers' admissions and lease events with the policy process's
    controller, and its list of served models; ``hellos`` counts the workers that have
    connected."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.server: asyncio.AbstractServer | None = None
        self.hellos = 0
        self.limit = frame_limit(gw.settings.max_body_bytes)
        self._peers: set[_Peer] = set()
        self._refresh: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, path: str) -> None:
        self.server = await asyncio.start_unix_server(self._serve, path)
        self.gw.ctl.replica_listeners.append(self._replica_changed)
        self.gw.model_listeners.append(self._models_changed)

    def _models_changed(self, models: list[dict[str, Any]]) -> None:
        """The policy process's list changed: every worker gets it."""
        for peer in list(self._peers):
            with contextlib.suppress(Exception):
                peer.send({"op": "models", "id": -1, "models": models})

    async def _send_models(self, peer: _Peer, rid: int) -> None:
        """A worker asked: refresh the list (one refresh for the askers of the moment)
        and answer with it."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self.gw.refresh_models())
        with contextlib.suppress(Exception):
            await asyncio.shield(self._refresh)
        peer.send({"op": "models", "id": rid, "models": self.gw.models})

    def _replica_changed(self, replica: int, healthy: bool, why: str) -> None:
        """A replica went down: the workers end their requests in flight there too."""
        if healthy:
            return
        for peer in list(self._peers):
            with contextlib.suppress(Exception):
                peer.send({"op": "abort", "id": -1, "replica": replica,
                           "reason": f"replica {replica} was marked unhealthy"})

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        with contextlib.suppress(ValueError):
            self.gw.model_listeners.remove(self._models_changed)
        for task in self._tasks:
            task.cancel()
        for peer in list(self._peers):
            peer.writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _Peer(writer, self.limit)
        self._peers.add(peer)
        try:
            while (msg := await read_frame(reader, self.limit)) is not None:
                self._handle(peer, msg)
        except (ConnectionError, ValueError) as e:
            log.warning("worker %s: the link failed: %s", peer.worker, e)
        finally:
            self._peers.discard(peer)
            for task in peer.admitting.values():
                task.cancel()
            for lease in peer.leases.values():
                lease.finish(lease.prompt_tokens)
            peer.leases.clear()
            writer.close()
            if self.server is not None and self.server.is_serving():
                log.warning("worker %s disconnected; its requests were ended", peer.worker)

    def _handle(self, peer: _Peer, msg: dict[str, Any]) -> None:
        op, rid = msg.get("op"), msg.get("id", -1)
        if op == "admit":
            peer.admitting[rid] = asyncio.create_task(self._admit(peer, msg))
        elif op == "finish":
            lease = peer.leases.pop(rid, None)
            if lease is not None:
                lease.finish(int(msg["context"]), StepFacts.from_msg(msg.get("step")))
        elif op == "first":
            if (lease := peer.leases.get(rid)) is not None:
                lease.answering()
        elif op == "kv_ready":
            if (lease := peer.leases.get(rid)) is not None:
                lease.kv_ready()
        elif op == "failed":
            if (lease := peer.leases.get(rid)) is not None:
                lease.failed(UpstreamError(str(msg["message"]),
                                           status=int(msg.get("status", 502)),
                                           unhealthy=bool(msg["unhealthy"])))
        elif op == "abandon":
            task = peer.admitting.pop(rid, None)
            if task is not None:
                task.cancel()
            lease = peer.leases.pop(rid, None)
            if lease is not None:
                lease.finish(lease.prompt_tokens)
        elif op == "counts":
            self._count(peer, msg)
        elif op == "models":
            task = asyncio.create_task(self._send_models(peer, rid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif op == "hello":
            peer.worker = str(msg.get("worker", "?"))
            self.hellos += 1
            peer.send({"op": "hello", "id": rid, "gpu_tokens": self.gw.gpu_tokens(),
                       "models": self.gw.models})

    async def _admit(self, peer: _Peer, msg: dict[str, Any]) -> None:
        rid = msg["id"]
        ctl = self.gw.ctl
        try:
            lease = await ctl.lease(str(msg["pid"]), int(msg["tokens"]), bool(msg["anon"]),
                                    RequestFacts.from_msg(msg.get("facts")))
        except AdmissionRejected as e:
            peer.send({"op": "reject", "id": rid, "status": e.status, "message": e.message,
                       "retry_after": e.retry_after_s})
            return
        except Exception:  # a bug must not leave the worker waiting for ever
            log.exception("admitting a worker's request failed")
            peer.send({"op": "reject", "id": rid, "status": 503, "retry_after": 5.0,
                       "message": "the gateway could not admit the request; retry later"})
            return
        finally:
            peer.admitting.pop(rid, None)
        peer.leases[rid] = lease
        try:
            await ctl.replicas.controls_done(lease.replica.index)
        except BaseException:
            peer.leases.pop(rid, None)
            lease.finish(lease.prompt_tokens)
            raise
        if rid in peer.leases:  # not abandoned meanwhile
            lease.sending()
            peer.send({"op": "go", "id": rid, "replica": lease.replica.index,
                       "reloaded": lease.admission.reloaded, "priority": lease.priority})

    def _count(self, peer: _Peer, msg: dict[str, Any]) -> None:
        m = self.gw.metrics
        served = 0
        for path, status, n in msg.get("requests", ()):
            m.requests.labels(path, str(status)).inc(n)
            served += n
        if served:
            m.worker_requests.labels(peer.worker).inc(served)
        for name in WORKER_TALLIES:
            if n := msg.get(name, 0):
                getattr(m, name).inc(n)
        for v in msg.get("ttft", ()):
            m.ttft.observe(v)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is told at start (on its standard input: it may hold keys)."""

    worker: int
    line_fd: int  # its end of the line connections arrive on (mori.gateway.handoff)
    ipc_path: str
    policy_url: str  # the policy process's own listener, for the endpoints workers pass on
    backends: list[str]
    settings: dict[str, Any]
    log_level: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> WorkerSpec:
        return WorkerSpec(**json.loads(text))


def spawn_worker(spec: WorkerSpec) -> subprocess.Popen[bytes]:
    """Start a ``python -m mori.gateway.worker_process`` process (its spec on stdin, its line's
    end inherited)."""
    p = subprocess.Popen([sys.executable, "-m", "mori.gateway.worker_process"],
                         stdin=subprocess.PIPE, pass_fds=(spec.line_fd,))
    assert p.stdin is not None
    p.stdin.write(spec.to_json().encode())
    p.stdin.close()
    return p


async def keep_workers(procs: list[subprocess.Popen[bytes]],
                       restart: Callable[[int], subprocess.Popen[bytes]], *,
                       poll_s: float = 0.25, pause_s: float = 0.5, max_pause_s: float = 30.0,
                       steady_s: float = 60.0) -> None:
    """Watch the workers until cancelled, starting again one that exits with
    ``restart(index)`` (``procs`` is updated in place). The pause before a start doubles on each exit that comes within
    ``steady_s`` of the last start, up to ``max_pause_s``, so a worker that cannot start
    does not spin."""
    loop = asyncio.get_running_loop()
    started = [loop.time()] * len(procs)
    pauses = [pause_s] * len(procs)
    due: dict[int, float] = {}  # a worker that exited: when it is started again
    while True:
        await asyncio.sleep(poll_s)
        now = loop.time()
        for i, p in enumerate(procs):
            if p.poll() is None:
                continue
            if i not in due:
                if now - started[i] >= steady_s:
                    pauses[i] = pause_s
                due[i] = now + pauses[i]
                log.warning("gateway worker %d exited (code %s); starting it again in %.1f s",
                            i + 1, p.returncode, pauses[i])
                pauses[i] = min(max_pause_s, pauses[i] * 2)
            elif now >= due[i]:
                procs[i] = restart(i)
                started[i] = now
                del due[i]


def stop_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
