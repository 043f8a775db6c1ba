"""API keys, admin keys and per-key program namespaces (``mori.gateway.auth``), through
a real gateway in front of a simulated engine, driven by the official ``openai`` client;
and the key options of ``mori serve`` (flags, key files, the environment, the refusal to
listen on a non-loopback address without keys)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_harness import LoopThread, serve_on_simulated

from mori.cli.main import build_parser, main
from mori.cli.serve_cmd import ServeUsageError, build_config
from mori.gateway.app import Gateway
from mori.gateway.config import GatewaySettings
from mori.gateway.server import ServeConfig
from mori.protocol.fields import MAX_PROGRAM_ID_BYTES_LIMIT

KEY_A = "sk-alpha-3f9c1e7a5b"
KEY_B = "sk-bravo-8d2e6b4c0a"
KEY_ADMIN = "sk-admin-71c5a9e3f2"
KEYS = (KEY_A, KEY_B, KEY_ADMIN)


class Served:
    """One keyed gateway in front of one simulated engine, served for the whole module."""

    def __init__(self, lt: LoopThread, url: str, gw: Gateway, engine_url: str,
                 model: str) -> None:
        self.lt, self.url, self.gw, self.engine_url, self.model = (
            lt, url, gw, engine_url, model)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    lt = LoopThread()
    sim = serve_on_simulated(lt, GatewaySettings(time_scale=50.0, hold_timeout_s=30,
                                                 api_keys=(KEY_A, KEY_B),
                                                 admin_keys=(KEY_ADMIN,)))
    try:
        model = client(sim.url, KEY_A).models.list().data[0].id
        yield Served(lt, sim.url, sim.gw, sim.adapters[0].url, model)
    finally:
        lt.close()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def chat(s: Served, key: str, pid: str | None, content: str = "hello",
         max_tokens: int = 2) -> str:
    extra = {"program_id": pid} if pid is not None else None
    r = client(s.url, key).chat.completions.create(
        model=s.model, messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens, extra_body=extra)
    return r.choices[0].message.content or ""


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def get(s: Served, path: str, key: str | None) -> httpx.Response:
    return httpx.get(s.url + path, headers=auth(key), timeout=30)


def listed(s: Served, key: str) -> dict[str, dict[str, Any]]:
    r = get(s, "/v1/programs", key)
    assert r.status_code == 200, r.text
    return {p["program_id"]: p for p in r.json()["data"]}


def describe(s: Served, key: str, pid: str) -> dict[str, Any]:
    r = get(s, f"/v1/programs/{pid}", key)
    assert r.status_code == 200, r.text
    d: dict[str, Any] = r.json()
    return d


def stable(d: dict[str, Any]) -> dict[str, Any]:
    """What of a program only its own steps change (its idleness grows with time)."""
    return {k: d[k] for k in ("program_id", "steps", "context_tokens", "last_step")}


# -- who may call the OpenAI endpoints ---------------------------------------------------------

@pytest.mark.parametrize("key", ["sk-wrong-key", KEY_A + "x", KEY_A[:-1], KEY_A.upper()],
                         ids=["wrong", "longer", "shorter", "upper-case"])
def test_a_missing_or_wrong_key_is_401(served: Served, key: str) -> None:
    c = client(served.url, key)
    with pytest.raises(openai.AuthenticationError) as e:
        c.chat.completions.create(model=served.model, max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}],
                                  extra_body={"program_id": "denied"})
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "invalid_api_key"
    assert e.value.response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model=served.model, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    assert "denied" not in listed(served, KEY_ADMIN)  # nothing was registered


def test_no_authorization_header_at_all_is_401(served: Served) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    for headers in ({}, {"Authorization": KEY_A}, {"Authorization": f"Basic {KEY_A}"},
                    {"Authorization": "Bearer"}):
        r = httpx.post(served.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/v1/programs", "/v1/programs/x"):
        r = get(served, path, None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    r = httpx.post(served.url + "/v1/programs/x/release")
    assert r.status_code == 401


def test_each_key_and_the_admin_key_can_complete(served: Served) -> None:
    for key in KEYS:
        assert len(chat(served, key, None, max_tokens=3).split()) == 3
        r = client(served.url, key).completions.create(model=served.model, prompt="hi",
                                                       max_tokens=2)
        assert len(r.choices[0].text.split()) == 2


# -- namespaces --------------------------------------------------------------------------------

def test_two_keys_with_one_program_id_drive_two_programs(served: Served) -> None:
    chat(served, KEY_A, "shared", "one two three")
    chat(served, KEY_A, "shared", "four five six")
    chat(served, KEY_B, "shared", "a much longer prompt " * 20)
    a, b = describe(served, KEY_A, "shared"), describe(served, KEY_B, "shared")
    assert a["program_id"] == b["program_id"] == "shared"
    assert a["steps"] == 2 and b["steps"] == 1
    assert a["context_tokens"] != b["context_tokens"]
    la, lb = listed(served, KEY_A), listed(served, KEY_B)
    assert la["shared"]["steps"] == 2 and lb["shared"]["steps"] == 1
    assert all("/" not in pid for pid in (*la, *lb))  # no key sees another's tag
    every = listed(served, KEY_ADMIN)
    internal = [pid for pid in every if pid.endswith("/shared")]
    assert len(internal) == 2 and internal[0] != internal[1]
    assert sorted(every[p]["steps"] for p in internal) == [1, 2]
    for pid in internal:
        assert not any(k in pid for k in KEYS)  # the tag is not the key
        assert describe(served, KEY_ADMIN, pid)["program_id"] == pid


def test_another_keys_program_is_404_to_read_and_release(served: Served) -> None:
    chat(served, KEY_A, "only-a", "private words here")
    before = stable(describe(served, KEY_A, "only-a"))
    for path in ("/v1/programs/only-a", "/v1/programs/only-a/release"):
        r = (get(served, path, KEY_B) if not path.endswith("release")
             else httpx.post(served.url + path, headers=auth(KEY_B)))
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["code"] == "program_not_found"
    (tag_a,) = [p for p in listed(served, KEY_ADMIN) if p.endswith("/only-a")]
    for pid in (tag_a, tag_a.replace("/", "%2F")):  # naming the internal id does not help
        assert get(served, f"/v1/programs/{pid}", KEY_B).status_code == 404
        assert httpx.post(f"{served.url}/v1/programs/{pid}/release",
                          headers=auth(KEY_B)).status_code == 404
    assert "only-a" not in listed(served, KEY_B)
    after = describe(served, KEY_A, "only-a")
    assert stable(after) == before and after["status"] != "released"
    chat(served, KEY_A, "only-a")  # still A's, still going
    assert describe(served, KEY_A, "only-a")["steps"] == before["steps"] + 1


def test_sending_under_another_keys_id_makes_ones_own_program(served: Served) -> None:
    chat(served, KEY_A, "taken", "the first key's context " * 10)
    before = stable(describe(served, KEY_A, "taken"))
    chat(served, KEY_B, "taken", "short")
    assert stable(describe(served, KEY_A, "taken")) == before
    mine = describe(served, KEY_B, "taken")
    assert mine["steps"] == 1 and mine["context_tokens"] < before["context_tokens"]
    r = httpx.post(served.url + "/v1/programs/taken/release", headers=auth(KEY_B))
    assert r.status_code == 200 and r.json() == {"program_id": "taken", "released": True}
    assert get(served, "/v1/programs/taken", KEY_B).status_code == 404
    assert stable(describe(served, KEY_A, "taken")) == before  # B released its own only


def test_the_admin_key_releases_any_program_by_its_internal_id(served: Served) -> None:
    chat(served, KEY_A, "to-end")
    (internal,) = [p for p in listed(served, KEY_ADMIN) if p.endswith("/to-end")]
    r = httpx.post(f"{served.url}/v1/programs/{internal}/release", headers=auth(KEY_ADMIN))
    assert r.status_code == 200 and r.json()["released"] is True
    assert get(served, "/v1/programs/to-end", KEY_A).status_code == 404


def test_the_admin_keys_own_programs_are_namespaced_too(served: Served) -> None:
    chat(served, KEY_ADMIN, "admins")
    (internal,) = [p for p in listed(served, KEY_ADMIN) if p.endswith("/admins")]
    assert internal != "admins"
    assert "admins" not in listed(served, KEY_A)


def test_an_anonymous_request_is_seen_only_by_its_key(served: Served) -> None:
    c = client(served.url, KEY_A)
    stream = c.chat.completions.create(model=served.model, stream=True, max_tokens=20_000,
                                       messages=[{"role": "user", "content": "go on"}])
    try:
        next(iter(stream))  # started; not read further, so it stays in flight
        mine = [p for p in listed(served, KEY_A).values() if p["anonymous"]]
        assert mine and all(p["in_flight"] for p in mine)
        assert all(p["held_because"] is None for p in mine)  # running: nothing held
        assert all(p["program_id"].startswith("anon-") for p in mine)
        assert not any(p["anonymous"] for p in listed(served, KEY_B).values())
        for p in mine:
            assert get(served, f"/v1/programs/{p['program_id']}", KEY_B).status_code == 404
    finally:
        stream.close()
    deadline = time.monotonic() + 10
    while any(p["anonymous"] for p in listed(served, KEY_A).values()):
        assert time.monotonic() < deadline, "the anonymous program did not end"
        time.sleep(0.05)


def test_the_longest_id_under_a_key_still_reaches_the_engine(served: Served) -> None:
    """The namespace lengthens an id by 13 bytes: with the largest id limit, a keyed id is
    refused by the gateway (400, saying the limit) before it could pass the engines'."""
    gw = served.gw
    before = gw.settings
    gw.settings = dataclasses.replace(before, max_program_id_bytes=MAX_PROGRAM_ID_BYTES_LIMIT)
    try:
        longest = "p" * (MAX_PROGRAM_ID_BYTES_LIMIT - 13)
        chat(served, KEY_A, longest)
        assert describe(served, KEY_A, longest)["steps"] == 1
        with pytest.raises(openai.BadRequestError) as e:
            chat(served, KEY_A, longest + "q")
        assert f"at most {MAX_PROGRAM_ID_BYTES_LIMIT - 13} bytes" in str(e.value)
        assert longest + "q" not in listed(served, KEY_A)
        assert all(len(p.encode()) <= MAX_PROGRAM_ID_BYTES_LIMIT
                   for p in listed(served, KEY_ADMIN))
    finally:
        gw.settings = before
    with pytest.raises(openai.BadRequestError, match="at most 256 bytes"):
        chat(served, KEY_A, "p" * 257)  # below the engines' limit: the configured one


# -- admin-only endpoints -------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/decisions", "/v1/residency", "/metrics",
                                  "/dashboard/state"])
def test_inspection_endpoints_need_an_admin_key(served: Served, path: str) -> None:
    r = get(served, path, None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert get(served, path, "sk-nobody").status_code == 401
    for key in (KEY_A, KEY_B):
        r = get(served, path, key)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "admin_key_required"
        assert r.json()["error"]["type"] == "permission_error"
    assert get(served, path, KEY_ADMIN).status_code == 200


def test_the_openai_client_sees_a_permission_error(served: Served) -> None:
    with pytest.raises(openai.PermissionDeniedError):
        client(served.url, KEY_A).get("/decisions", cast_to=object)
    assert isinstance(client(served.url, KEY_ADMIN).get("/decisions", cast_to=object), dict)


def test_public_metrics_opens_only_metrics(served: Served) -> None:
    gw = served.gw
    keyed = gw.settings
    gw.settings = dataclasses.replace(keyed, public_metrics=True)
    try:
        r = get(served, "/metrics", None)
        assert r.status_code == 200 and "mori_" in r.text
        assert get(served, "/metrics", KEY_A).status_code == 200
        assert get(served, "/v1/decisions", None).status_code == 401
        assert get(served, "/v1/residency", KEY_A).status_code == 403
    finally:
        gw.settings = keyed
    assert get(served, "/metrics", None).status_code == 401


def test_healthz_names_the_replicas_only_to_an_admin(served: Served) -> None:
    for key in (None, "sk-nobody", KEY_A):
        r = get(served, "/healthz", key)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert served.engine_url not in r.text
    r = get(served, "/healthz", KEY_ADMIN)
    assert r.status_code == 200
    assert [x["url"] for x in r.json()["replicas"]] == [served.engine_url]


# -- keys are never shown --------------------------------------------------------------------

def test_keys_never_reach_the_log(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        chat(served, KEY_A, "logged")
        chat(served, KEY_B, "logged")
        chat(served, KEY_ADMIN, None)
        with pytest.raises(openai.AuthenticationError):
            chat(served, "sk-guess-0000000000", "logged")
        for key in KEYS:
            get(served, "/v1/decisions", key)
            get(served, "/healthz", key)
        httpx.post(served.url + "/v1/programs/logged/release", headers=auth(KEY_A))
    assert caplog.records  # something was logged
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    for key in (*KEYS, "sk-guess-0000000000"):
        assert key not in text


def test_the_settings_repr_hides_the_keys() -> None:
    s = GatewaySettings(api_keys=(KEY_A,), admin_keys=(KEY_ADMIN,))
    cfg = ServeConfig(settings=s)
    for text in (repr(s), str(s), repr(cfg)):
        assert KEY_A not in text and KEY_ADMIN not in text


# -- mori serve: the key options -------------------------------------------------------------

@pytest.fixture
def no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORI_API_KEYS", raising=False)
    monkeypatch.delenv("MORI_ADMIN_KEYS", raising=False)


def config(argv: list[str]) -> ServeConfig:
    return build_config(build_parser().parse_args(["serve", *argv]))


def test_a_public_address_without_keys_refuses_to_start() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MORI_API_KEYS", "MORI_ADMIN_KEYS")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mori", "serve", "--host", "0.0.0.0",
                           "--port", "0"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "mori serve: error:" in proc.stderr
    assert "--api-key" in proc.stderr and "--allow-unauthenticated" in proc.stderr
    assert "listening" not in proc.stdout and "gateway up" not in proc.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.usefixtures("no_key_env")
def test_the_refusal_and_its_ways_out() -> None:
    with pytest.raises(ServeUsageError) as e:
        config(["--host", "0.0.0.0"])
    assert "--api-key" in str(e.value) and "--allow-unauthenticated" in str(e.value)
    assert config(["--host", "0.0.0.0", "--allow-unauthenticated"]).allow_unauthenticated
    cfg = config(["--host", "0.0.0.0", "--api-key", KEY_A, "--api-key", KEY_B])
    assert cfg.settings.api_keys == (KEY_A, KEY_B)
    for host in ("127.0.0.1", "localhost", "::1"):
        assert config(["--host", host]).settings.api_keys == ()


@pytest.mark.usefixtures("no_key_env")
def test_key_files_merge_with_flags(tmp_path: Path) -> None:
    f = tmp_path / "keys.txt"
    f.write_text(f"# the team's keys\n{KEY_B}\n\n  {KEY_A}  \n")
    g = tmp_path / "admin.txt"
    g.write_text(KEY_ADMIN + "\n")
    cfg = config(["--api-key", KEY_A, "--api-key-file", str(f), "--admin-key-file", str(g)])
    assert cfg.settings.api_keys == (KEY_A, KEY_B)  # duplicates once
    assert cfg.settings.admin_keys == (KEY_ADMIN,)


@pytest.mark.usefixtures("no_key_env")
def test_a_missing_or_empty_key_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-keys.txt"
    for flag in ("--api-key-file", "--admin-key-file"):
        with pytest.raises(ServeUsageError) as e:
            config([flag, str(missing)])
        assert str(missing) in str(e.value)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ServeUsageError) as e:
        config(["--api-key-file", str(empty)])
    assert str(empty) in str(e.value) and "no key" in str(e.value)


@pytest.mark.usefixtures("no_key_env")
def test_a_missing_key_file_through_the_command(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.keys"
    assert main(["serve", "--port", "0", "--api-key-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mori serve: error: cannot read the key file") and str(missing) in err


def test_the_environment_merges_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_API_KEYS", f" {KEY_B},  sk-env-third ")
    monkeypatch.setenv("MORI_ADMIN_KEYS", KEY_ADMIN)
    cfg = config(["--host", "0.0.0.0", "--api-key", KEY_A])
    assert cfg.settings.api_keys == (KEY_A, KEY_B, "sk-env-third")
    assert cfg.settings.admin_keys == (KEY_ADMIN,)
    monkeypatch.setenv("MORI_API_KEYS", KEY_A)
    assert config(["--host", "0.0.0.0"]).settings.api_keys == (KEY_A,)  # env alone suffices


@pytest.mark.usefixtures("no_key_env")
@pytest.mark.parametrize("flag", ["--api-key", "--admin-key"])
@pytest.mark.parametrize("key", ["two words", "tab\there", " lead", "trail\n"],
                         ids=["space", "tab", "leading", "trailing-newline"])
def test_a_malformed_key_is_refused(flag: str, key: str, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    with pytest.raises(ServeUsageError) as e:
        config([flag, key])
    assert "whitespace" in str(e.value)
    assert key.strip() not in str(e.value)  # not echoed back
    assert main(["serve", flag, key, "--port", "0"]) == 2
    assert "whitespace" in capsys.readouterr().err


@pytest.mark.usefixtures("no_key_env")
def test_an_empty_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--api-key", "", "--port", "0"]) == 2
    assert "--api-key" in capsys.readouterr().err


@pytest.mark.usefixtures("no_key_env")
def test_a_malformed_key_in_a_file_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "keys.txt"
    f.write_text("has a space\n")
    with pytest.raises(ServeUsageError, match="whitespace"):
        config(["--api-key-file", str(f)])
    monkeypatch.setenv("MORI_ADMIN_KEYS", "one,two\tthree\nfour")  # any separator
    assert config([]).settings.admin_keys == ("one", "two", "three", "four")


def test_keys_never_reach_the_usage_error(tmp_path: Path, no_key_env: None) -> None:
    with pytest.raises(ServeUsageError) as e:
        config(["--api-key", KEY_A, "--api-key", "bad key", "--host", "0.0.0.0"])
    assert KEY_A not in str(e.value)
