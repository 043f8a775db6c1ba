"""What a program costs the gateway, and a key's bound on it: ``--max-programs-per-key``
(429 beyond), ``/v1/programs`` a page at a time, and a key's own listing that costs what
its own programs do, not every program's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_harness import LoopThread, SimGateway, serve_on_simulated

from mori.gateway.config import GatewaySettings

KEY_A = "sk-alpha-3f9c1e7a5b"
KEY_B = "sk-bravo-8d2e6b4c0a"
KEY_ADMIN = "sk-admin-71c5a9e3f2"
LIMIT = 3


@pytest.fixture(scope="module")
def served() -> Iterator[SimGateway]:
    lt = LoopThread()
    try:
        yield serve_on_simulated(lt, GatewaySettings(
            time_scale=50.0, api_keys=(KEY_A, KEY_B), admin_keys=(KEY_ADMIN,),
            max_programs_per_key=LIMIT))
    finally:
        lt.close()


def ask(s: SimGateway, key: str, pid: str) -> httpx.Response:
    model = httpx.get(s.url + "/v1/models", headers=auth(key)).json()["data"][0]["id"]
    return httpx.post(s.url + "/v1/chat/completions", headers=auth(key), timeout=30, json={
        "model": model, "max_tokens": 4, "program_id": pid,
        "messages": [{"role": "user", "content": "hi"}]})


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def page(s: SimGateway, key: str, **q: Any) -> dict[str, Any]:
    r = httpx.get(s.url + "/v1/programs", headers=auth(key), params=q, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_key_past_its_program_limit_gets_429_and_others_do_not(served: SimGateway) -> None:
    for i in range(LIMIT):
        assert ask(served, KEY_A, f"a{i}").status_code == 200
    assert ask(served, KEY_A, "a0").status_code == 200  # its own again: not a new one
    r = ask(served, KEY_A, "one-too-many")
    assert r.status_code == 429 and "retry-after" in r.headers
    assert "--max-programs-per-key" in r.json()["error"]["message"]
    assert ask(served, KEY_B, "b0").status_code == 200  # another key's own budget
    rel = httpx.post(served.url + "/v1/programs/a1/release", headers=auth(KEY_A))
    assert rel.status_code == 200
    assert ask(served, KEY_A, "one-too-many").status_code == 200  # room again
    for pid in ("a0", "a2", "one-too-many"):
        httpx.post(f"{served.url}/v1/programs/{pid}/release", headers=auth(KEY_A))
    httpx.post(served.url + "/v1/programs/b0/release", headers=auth(KEY_B))


def test_listings_come_a_page_at_a_time(served: SimGateway) -> None:
    ids = [f"p{i:02d}" for i in range(LIMIT)]
    for pid in ids:
        assert ask(served, KEY_B, pid).status_code == 200
    first = page(served, KEY_B, limit=2)
    assert [r["program_id"] for r in first["data"]] == ids[:2] and first["has_more"]
    assert first["first_id"] == ids[0] and first["last_id"] == ids[1]
    rest = page(served, KEY_B, limit=2, after=first["last_id"])
    assert [r["program_id"] for r in rest["data"]] == ids[2:] and not rest["has_more"]
    assert page(served, KEY_A)["data"] == []  # nothing of B's shows to A
    everyone = page(served, KEY_ADMIN)
    assert {r["program_id"].split("/", 1)[1] for r in everyone["data"]} >= set(ids)
    bad = httpx.get(served.url + "/v1/programs", headers=auth(KEY_B), params={"limit": 0})
    assert bad.status_code == 400 and "limit" in bad.json()["error"]["message"]
    for pid in ids:
        httpx.post(f"{served.url}/v1/programs/{pid}/release", headers=auth(KEY_B))


def test_a_keys_listing_reads_only_its_own_programs(served: SimGateway,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = served.gw.ctl
    assert ask(served, KEY_A, "mine").status_code == 200
    # many programs of another namespace, straight into the controller's books
    for i in range(2000):
        ctl.quotas.owned.setdefault("elsewhere", set()).add(f"elsewhere/q{i}")
    read: list[str] = []
    real = ctl.describe

    def counted(pid: str) -> Any:
        read.append(pid)
        return real(pid)

    monkeypatch.setattr(ctl, "describe", counted)
    rows = page(served, KEY_A)["data"]
    assert [r["program_id"] for r in rows] == ["mine"]
    assert len(read) == 1  # not 2,001
    del ctl.quotas.owned["elsewhere"]
    httpx.post(served.url + "/v1/programs/mine/release", headers=auth(KEY_A))
