"""The engine adapter registry, and ``--backend KIND=URL[,key=value...]`` specs."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from mori.core.registry import Registry
from mori.engines.base import EngineAdapter
from mori.engines.http import OpenAIHTTPAdapter
from mori.engines.sglang import SGLangAdapter
from mori.engines.simulated import SimEngineAdapter
from mori.engines.vllm import VLLMAdapter


def _build() -> Registry[type[EngineAdapter]]:
    reg: Registry[type[EngineAdapter]] = Registry("engine kind")
    for cls in (OpenAIHTTPAdapter, SimEngineAdapter, VLLMAdapter, SGLangAdapter):
        reg.register(cls.kind, cls)
    reg.freeze()
    return reg


ADAPTERS = _build()
"""Every engine adapter kind, by name (frozen)."""


class BackendSpecError(ValueError):
    """A ``--backend`` value that cannot be used, with what was wrong."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    kind: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def build(self) -> EngineAdapter:
        cls = ADAPTERS.get(self.kind)
        params = inspect.signature(cls.__init__).parameters
        accepted = [n for n, p in params.items()
                    if n not in ("self", "url") and p.kind is p.KEYWORD_ONLY]
        unknown = sorted(set(self.options) - set(accepted))
        if unknown:
            raise BackendSpecError(
                f"backend {self.kind}={self.url}: unknown option(s) {', '.join(unknown)}; "
                f"{self.kind} takes: {', '.join(accepted) or '(none)'}")
        options = dict(self.options)
        for name, value in self.options.items():
            # "auto" for a ``bool | None`` option: leave it to the adapter's detection
            if value == "auto" and str(params[name].annotation).replace(" ", "") == "bool|None":
                options[name] = None
        return cls(self.url, **options)


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


_VERBATIM = frozenset({"token", "label_secret_file"})
"""Options kept as the text given (a secret such as ``token=0123`` is not a number)."""
LABEL_KINDS = frozenset({"vllm", "sglang"})
"""The engine kinds whose ``labels=`` option is a MORI plug-in's label channel."""
_SECRET = re.compile(r"((?:^|,)token=)[^,]*")


def shown(spec: str) -> str:
    """A ``--backend`` spec as it may be printed: secrets (``token=``) hidden."""
    return _SECRET.sub(r"\1***", spec)


def parse_backend(spec: str) -> BackendSpec:
    """``vllm=http://host:8000,kv_events=tcp://host:5557`` -> BackendSpec."""
    kind, sep, rest = spec.partition("=")
    if not sep or not kind or not rest:
        raise BackendSpecError(f"backend {spec!r}: expected KIND=URL[,key=value...], e.g. "
                               f"vllm=http://127.0.0.1:8000; kinds: {', '.join(ADAPTERS.names())}")
    kind = kind.strip()
    if kind not in ADAPTERS:
        raise BackendSpecError(f"backend {spec!r}: unknown engine kind {kind!r}; valid: "
                               f"{', '.join(ADAPTERS.names())}")
    url, *opts = rest.split(",")
    if not url.startswith(("http://", "https://")):
        raise BackendSpecError(f"backend {spec!r}: the URL must start with http:// or https://")
    options: dict[str, Any] = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or not k.strip():
            raise BackendSpecError(f"backend {spec!r}: option {o!r} is not key=value")
        key = k.strip()
        options[key] = v.strip() if key in _VERBATIM else _value(v.strip())
    return BackendSpec(kind, url.rstrip("/"), options)


def with_label_secret(spec: str, secret_file: str | None) -> str:
    """``spec`` with ``label_secret_file=secret_file`` added when it names a label channel
    (``labels=``) of a vLLM or SGLang engine and no secret file of its own (``mori serve
    --label-secret-file``: the default for every backend)."""
    if not secret_file:
        return spec
    kind, _, rest = spec.partition("=")
    keys = {o.partition("=")[0].strip() for o in rest.split(",")[1:]}
    if kind.strip() not in LABEL_KINDS or "labels" not in keys \
            or "label_secret_file" in keys:
        return spec
    if "," in secret_file:
        raise BackendSpecError(f"--label-secret-file {secret_file!r}: a path in a backend "
                               "spec holds no comma")
    return f"{spec},label_secret_file={secret_file}"
