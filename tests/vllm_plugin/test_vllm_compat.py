"""Which vLLM releases the plug-in accepts (``mori.vllm_plugin.compat``, no vLLM needed),
and ``mori vllm-args``' warning for one outside them."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from mori.cli.main import main
from mori.vllm_plugin import compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version, release", [
    ("0.33.0", "0.33"), ("0.32.0+cpu", "0.32"), ("0.32.1rc1", "0.32"), ("1.0", "1.0"),
    ("10.02.3", "10.2"), ("dev", None), ("", None)])
def test_release_is_major_dot_minor(version: str, release: str | None) -> None:
    assert compat.release(version) == release


def test_supported_releases_load_and_others_are_refused_in_one_line() -> None:
    for version in ("0.32.0", "0.32.0+cpu", "0.33.0", "0.33.2", "0.34.0", "0.34.1"):
        assert compat.refusal(version, env={}) is None, version
    for version in ("0.31.0", "0.35.0", "1.0.0", "weird"):
        line = compat.refusal(version, env={})
        assert line is not None and "\n" not in line, version
        assert f"vLLM {version} " in line and "0.32.x, 0.33.x, 0.34.x" in line
        assert "mori vllm-args --no-plugin" in line and compat.UNVERIFIED_ENV in line
        with pytest.raises(compat.UnsupportedVllm) as e:
            compat.check(version, env={})
        assert str(e.value) == line
    # MORI_VLLM_UNVERIFIED=1 lets an unknown release load; only "1" does
    assert compat.refusal("0.35.0", env={compat.UNVERIFIED_ENV: "1"}) is None
    assert compat.refusal("0.35.0", env={compat.UNVERIFIED_ENV: "yes"}) is not None


def test_hook_problems_refuse_even_a_supported_release_and_the_override() -> None:
    line = compat.refusal("0.33.0", ["CachePolicy.insert now takes (key)", "b"],
                          env={compat.UNVERIFIED_ENV: "1"})
    assert line is not None and "\n" not in line
    assert "CachePolicy.insert now takes (key) (and 1 more)" in line
    assert "vLLM 0.33.0" in line and "mori vllm-args --no-plugin" in line


class Base:
    def get(self, key: int) -> int: ...
    def insert(self, key: int, chunk: int, req_context: object) -> None: ...
    def touch(self, keys: list[int]) -> None: ...
    def hook(self, keys: list[int]) -> None: ...


class Old(Base):  # the 0.32 shape against a 0.33 base
    def get(self, key: int) -> int: return key
    def insert(self, key: int, chunk: int) -> None: ...  # type: ignore[override]
    def touch(self, keys: list[int]) -> None: ...


class New(Base):
    def get(self, key: int) -> int: return key
    def insert(self, key: int, chunk: int, req_context: object = None,
               extra: int = 0) -> None: ...
    def touch(self, keys: list[int]) -> None: ...
    def hook(self, keys: list[int]) -> None: ...


class Renamed(New):
    def touch(self, key_list: list[int]) -> None: ...  # type: ignore[override]
    def get(self, key: int, must: int) -> int: return key  # type: ignore[override]


class StandIn:  # not a subclass: a class that takes the base's place (the typed queue)
    def get(self, *args: object, **kwargs: object) -> int: return 0


def test_hook_problems_name_what_vllm_would_call_that_the_class_cannot_take() -> None:
    names = ("get", "insert", "touch", "hook")
    assert compat.hook_problems(Base, New, names) == []
    assert compat.hook_problems(Base, Old, names) == [
        "Base.hook is new to the plug-in",
        "Base.insert now takes (key, chunk, req_context)"]
    assert compat.hook_problems(Base, Renamed, names) == [
        "Base.get now takes (key), not must",
        "Base.touch now takes (keys)"]
    assert compat.hook_problems(Base, StandIn, ["get", "insert"]) == [
        "Base.insert is new to the plug-in"]
    assert compat.hook_problems(Base, New, ["gone_from_vllm"]) == []


class Submit:  # a hook whose middle argument vLLM renamed (0.34: src_spec -> device_ptrs)
    def submit(self, job_id: int, device_ptrs: object, dst: object,
               expedited: bool = False) -> bool: return False
    def kw(self, job_id: int, *, spec: object) -> bool: return False


class ByPosition(Submit):
    def submit(self, job_id: int, engine: object, dst: object, /,
               expedited: bool = False) -> bool: return True
    def kw(self, job_id: int, spec: object, /) -> bool: return True  # type: ignore[override]


class ByName(Submit):
    def submit(self, job_id: int, src_spec: object, dst: object,
               expedited: bool = False) -> bool: return True


class TooShort(Submit):
    def submit(self, job_id: int, engine: object, /) -> bool: return True  # type: ignore[override]


def test_a_positional_only_parameter_takes_whatever_vllm_names_that_position() -> None:
    assert compat.hook_problems(Submit, ByPosition, ["submit"]) == []
    assert compat.hook_problems(Submit, ByName, ["submit"]) == [
        "Submit.submit now takes (job_id, device_ptrs, dst, expedited)"]
    assert compat.hook_problems(Submit, TooShort, ["submit"]) == [
        "Submit.submit now takes (job_id, device_ptrs, dst, expedited)"]
    # vLLM's keyword-only parameter cannot be passed to a positional-only one
    assert compat.hook_problems(Submit, ByPosition, ["kw"]) == [
        "Submit.kw now takes (job_id, spec)"]


def test_the_extra_pins_the_supported_releases() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["vllm"] == [f"vllm{compat.PIP_SPEC}"]
    lo, hi = compat.PIP_SPEC.split(",")
    assert lo == f">={min(compat.SUPPORTED, key=lambda r: tuple(map(int, r.split('.'))))}"
    newest = max(compat.SUPPORTED, key=lambda r: tuple(map(int, r.split("."))))
    major, minor = map(int, newest.split("."))
    assert hi == f"<{major}.{minor + 1}"


@pytest.mark.parametrize("installed, warns", [
    (None, False), ("0.32.0", False), ("0.33.0", False), ("0.34.0", False), ("0.35.0", True),
    ("0.31.1", True)])
def test_vllm_args_warns_when_the_installed_vllm_is_outside_the_range(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        installed: str | None, warns: bool) -> None:
    monkeypatch.setattr(compat, "installed_version", lambda: installed)
    assert main(["vllm-args", "--gpu"]) == 0
    out, err = capsys.readouterr()
    assert "--scheduler-cls" in out  # the flags are printed all the same
    if warns:
        assert err.count("\n") == 1 and err.startswith("mori vllm-args: warning: ")
        assert f"vLLM {installed} is installed here" in err and "--no-plugin" in err
    else:
        assert err == ""
    assert main(["vllm-args", "--no-plugin"]) == 0  # no plug-in: nothing to warn of
    assert capsys.readouterr().err == ""
