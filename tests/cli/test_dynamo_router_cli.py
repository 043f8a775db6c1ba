"""``mori dynamo-router``: its help, and its errors where Dynamo is not installed (the
router itself runs in tests/e2e/test_dynamo_router.py)."""

from __future__ import annotations

import importlib.util

import pytest

from mori.cli.main import main


def test_help_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dynamo-router", "--help"]) == 0
    out = capsys.readouterr().out
    for word in ("agent_context", "x-dynamo-session-id", "backend_instance_id",
                 "priority_jump", "session_final", "--hold-timeout", "--workers"):
        assert word in out, word


@pytest.mark.parametrize(("argv", "says"), [
    (["--endpoint", "backend.generate"], "namespace.component.endpoint"),
    (["--workers", "-1"], "--workers must be 0 or more"),
    (["--host-tokens", "-5"], "--host-tokens must be 0 or more"),
])
def test_bad_settings_are_named(argv: list[str], says: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dynamo-router", "--model-name", "m", "--model-path", "p", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mori dynamo-router: error: ") and says in err, err


@pytest.mark.skipif(importlib.util.find_spec("dynamo") is not None
                    and importlib.util.find_spec("dynamo.runtime") is not None,
                    reason="Dynamo is installed here")
def test_without_dynamo_it_says_where_to_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dynamo-router", "--model-name", "m", "--model-path", "p"]) == 2
    err = capsys.readouterr().err
    assert "Dynamo is not installed" in err and "scripts/dynamo_cpu_env.sh" in err, err
