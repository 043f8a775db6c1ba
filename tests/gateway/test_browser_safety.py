"""A keyless gateway on loopback is open to local programs, not to web pages: a request
with a foreign ``Origin`` (cross-site request forgery: a ``text/plain`` POST needs no CORS
preflight) or a ``Host`` that is not a loopback name or the gateway's own address (DNS
rebinding) is refused with 403, in the API's error shape, saying how to allow it
(``mori.gateway.auth.BrowserPolicy``). CORS is off unless ``--cors-origin`` names origins.
With keys, neither check applies (a browser does not send keys cross-site), and CORS
stays off unless configured. Real gateways in front of simulated engines; plain HTTP and
the official ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from gateway_harness import LoopThread, SimGateway, serve_on_simulated

from mori.cli.main import build_parser
from mori.cli.serve_cmd import ServeUsageError, build_config
from mori.gateway.auth import BrowserPolicy, KeyRing, host_name, normalize_origin
from mori.gateway.config import GatewaySettings

CHAT = "/v1/chat/completions"
KEY = "sk-browser-5c1d9e"
APP = "http://app.example:3000"


@pytest.fixture(scope="module")
def lt() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def keyless(lt: LoopThread) -> SimGateway:
    return serve_on_simulated(lt, GatewaySettings(time_scale=50.0))


@pytest.fixture(scope="module")
def with_cors(lt: LoopThread) -> SimGateway:
    return serve_on_simulated(lt, GatewaySettings(time_scale=50.0, cors_origins=(APP,),
                                                  allowed_hosts=("mori.lan",)))


@pytest.fixture(scope="module")
def keyed(lt: LoopThread) -> SimGateway:
    return serve_on_simulated(lt, GatewaySettings(time_scale=50.0, api_keys=(KEY,)))


def model(g: SimGateway) -> str:
    return g.gw.models[0]["id"] if g.gw.models else "x"


def chat_body(g: SimGateway, pid: str) -> dict[str, Any]:
    return {"model": model(g), "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "program_id": pid}


def port(g: SimGateway) -> int:
    return int(g.url.rsplit(":", 1)[1])


def known(g: SimGateway, pid: str) -> bool:
    return httpx.get(f"{g.url}/v1/programs/{pid}").status_code == 200


# -- cross-site request forgery ------------------------------------------------------------

def test_a_cross_origin_text_plain_post_is_refused(keyless: SimGateway) -> None:
    """A page of another site posts a form (``text/plain``: no preflight) to release a
    program and to run a completion: both refused, nothing done."""
    g = keyless
    assert httpx.post(g.url + CHAT, json=chat_body(g, "victim")).status_code == 200
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    r = httpx.post(g.url + "/v1/programs/victim/release", headers=evil)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "origin_not_allowed" and err["type"] == "permission_error"
    assert "'http://evil.example'" in err["message"]
    assert "--cors-origin http://evil.example" in err["message"]  # how to allow it
    assert known(g, "victim")  # not released
    r = httpx.post(g.url + CHAT, content=json.dumps(chat_body(g, "forged")), headers=evil)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert not known(g, "forged")
    for origin in ("null", "http://127.0.0.1.evil.example", "file://", "http://localhost.evil"):
        r = httpx.get(g.url + "/v1/programs", headers={"Origin": origin})
        assert r.status_code == 403, origin


def test_anthropic_paths_refuse_in_their_shape(keyless: SimGateway) -> None:
    r = httpx.post(keyless.url + "/v1/messages", json={}, headers={"Origin": "https://x.io"})
    assert r.status_code == 403
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "permission_error"
    r = httpx.post(keyless.url + "/v1/messages", json={},
                   headers={"Host": "attacker.example"})
    assert r.status_code == 403 and r.json()["type"] == "error"


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:5173",
                                    "http://[::1]:8080", "https://localhost"])
def test_loopback_origins_are_served(keyless: SimGateway, origin: str) -> None:
    g = keyless
    r = httpx.post(g.url + CHAT, json=chat_body(g, "local-page"), headers={"Origin": origin})
    assert r.status_code == 200, r.text
    assert "access-control-allow-origin" not in r.headers  # CORS is off: not configured


def test_cors_is_off_unless_configured(keyless: SimGateway) -> None:
    r = httpx.options(keyless.url + CHAT, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 405  # no preflight answer
    assert "access-control-allow-origin" not in r.headers
    assert r.json()["error"]["code"] == "method_not_allowed"


# -- DNS rebinding -------------------------------------------------------------------------

def test_a_foreign_host_is_refused(keyless: SimGateway) -> None:
    """A page at attacker.example, its name re-pointed at 127.0.0.1, reads the gateway:
    same-origin for the browser, but the Host is the attacker's name."""
    g = keyless
    for path in ("/v1/programs", "/v1/residency", "/dashboard", "/healthz"):
        r = httpx.get(g.url + path, headers={"Host": f"attacker.example:{port(g)}"})
        assert r.status_code == 403, path
        err = r.json()["error"]
        assert err["code"] == "host_not_allowed"
        assert "--allowed-host attacker.example" in err["message"]
    r = httpx.post(g.url + CHAT, json=chat_body(g, "rebound"),
                   headers={"Host": "attacker.example"})
    assert r.status_code == 403 and not known(g, "rebound")


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}",
                                  "localhost", "LOCALHOST.:{port}", "127.0.0.2"])
def test_loopback_hosts_are_served(keyless: SimGateway, host: str) -> None:
    r = httpx.get(keyless.url + "/v1/models",
                  headers={"Host": host.format(port=port(keyless))})
    assert r.status_code == 200, r.text


def test_clients_that_are_not_browsers_are_served(keyless: SimGateway) -> None:
    """What the SDKs and agent CLIs send: Host 127.0.0.1:PORT and no Origin."""
    c = openai.OpenAI(base_url=keyless.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model=model(keyless), max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content
    assert httpx.get(keyless.url + "/dashboard").status_code == 200


# -- configured: --cors-origin, --allowed-host ---------------------------------------------

def test_a_configured_origin_gets_cors(with_cors: SimGateway) -> None:
    g = with_cors
    r = httpx.options(g.url + CHAT, headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-program-id"})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == \
        "authorization, content-type, x-program-id"
    r = httpx.post(g.url + CHAT, json=chat_body(g, "from-app"), headers={"Origin": APP})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == APP
    assert "Origin" in r.headers["vary"]
    body = dict(chat_body(g, "from-app-stream"), stream=True)
    with httpx.stream("POST", g.url + CHAT, json=body, headers={"Origin": APP}) as s:
        assert s.headers["access-control-allow-origin"] == APP
        assert "data: [DONE]" in s.read().decode()
    r = httpx.get(g.url + "/nope", headers={"Origin": APP})  # errors too, so pages read them
    assert r.status_code == 404 and r.headers["access-control-allow-origin"] == APP


def test_other_origins_are_still_refused_without_keys(with_cors: SimGateway) -> None:
    g = with_cors
    r = httpx.post(g.url + CHAT, json=chat_body(g, "other"),
                   headers={"Origin": "http://other.example:3000"})
    assert r.status_code == 403
    r = httpx.options(g.url + CHAT, headers={"Origin": "http://other.example:3000",
                                             "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_an_allowed_host_and_its_own_pages_are_served(with_cors: SimGateway) -> None:
    g = with_cors
    own = {"Host": f"mori.lan:{port(g)}", "Origin": f"http://mori.lan:{port(g)}"}
    r = httpx.post(g.url + CHAT, json=chat_body(g, "lan"), headers=own)
    assert r.status_code == 200, r.text
    r = httpx.get(g.url + "/v1/models", headers={"Host": "other.lan"})
    assert r.status_code == 403


# -- with keys: no checks, CORS still off ----------------------------------------------------

def test_with_keys_the_checks_give_way_to_the_key(keyed: SimGateway) -> None:
    g = keyed
    auth = {"Authorization": f"Bearer {KEY}"}
    for extra in ({"Origin": "http://evil.example"}, {"Host": "attacker.example"}):
        r = httpx.post(g.url + CHAT, json=chat_body(g, "keyed"), headers={**auth, **extra})
        assert r.status_code == 200, r.text
        assert "access-control-allow-origin" not in r.headers
    r = httpx.post(g.url + CHAT, json=chat_body(g, "keyed"),
                   headers={"Origin": "http://evil.example"})
    assert r.status_code == 401  # no key: the key check still refuses


# -- the policy and the options ----------------------------------------------------------------

def test_the_policy_itself() -> None:
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost.:80") == "localhost"
    assert host_name("::1") == "::1" and host_name("10.0.0.5") == "10.0.0.5"
    assert normalize_origin("HTTP://App.Example:80/") == "http://app.example"
    assert normalize_origin("https://a.b:443") == "https://a.b"
    for bad in ("app.example", "http://a/b", "ftp://a", "null", "http://u@a"):
        with pytest.raises(ValueError, match="origin"):
            normalize_origin(bad)
    p = BrowserPolicy.of(KeyRing())
    assert p.refusal("127.0.0.1:8000", None, "127.0.0.1") is None
    assert p.refusal("10.0.0.5:8000", None, "10.0.0.5") is None  # its own address
    assert p.refusal("10.0.0.5:8000", "http://10.0.0.5:8000", "10.0.0.5") is None
    assert p.refusal(None, None, None) is None  # an HTTP/1.0 client without Host
    refused = p.refusal("evil.example", None, "127.0.0.1")
    assert refused is not None and refused[0] == "host_not_allowed"
    refused = p.refusal("127.0.0.1", "http://10.0.0.9", "127.0.0.1")
    assert refused is not None and refused[0] == "origin_not_allowed"
    long = p.refusal("a" * 100_000, None, None)
    assert long is not None and len(long[1]) < 1500  # the echoed Host is cut
    assert BrowserPolicy.of(KeyRing(("k",))).refusal("evil", "http://evil", None) is None
    assert not BrowserPolicy.of(KeyRing(("k",))).active
    anyone = BrowserPolicy.of(KeyRing(), ("*",), ("*",))
    assert anyone.refusal("any.name", "http://any.site", None) is None


def test_the_serve_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORI_API_KEYS", raising=False)
    monkeypatch.delenv("MORI_ADMIN_KEYS", raising=False)
    cfg = build_config(build_parser().parse_args([
        "serve", "--cors-origin", "http://localhost:3000", "--cors-origin",
        "HTTPS://App.Example/", "--allowed-host", "mori.lan"]))
    assert cfg.settings.cors_origins == ("http://localhost:3000", "https://app.example")
    assert cfg.settings.allowed_hosts == ("mori.lan",)
    assert GatewaySettings().cors_origins == () and GatewaySettings().allowed_hosts == ()
    with pytest.raises(ServeUsageError, match="not an origin"):
        build_config(build_parser().parse_args(["serve", "--cors-origin", "localhost:3000"]))
    # a worker's settings arrive as JSON lists
    s = GatewaySettings(cors_origins=[APP], allowed_hosts=["mori.lan"])  # type: ignore[arg-type]
    assert s.cors_origins == (APP,) and s.allowed_hosts == ("mori.lan",)
