"""``--config FILE.toml``: a command's options read from a TOML file.

One loader for ``mori simulate`` and ``mori serve``, each with its own option table
(:data:`~mori.cli.options.BY_KEY`, :data:`~mori.cli.options.SERVE_BY_KEY`). Keys are the
long option names with dashes or underscores (``cpu-ratio`` or ``cpu_ratio``); list
options take an array, a single value or a comma-separated string::

    policy = ["mori", "smg"]
    programs = [20, 50]
    duration = 600
    share_prefix = true

Relative paths (``traces``, ``json``, ``plot``) are taken relative to the file's folder;
a ``traces`` value that names a shipped trace set (``mori traces``) and no file there
stays a name.
Any problem is a :class:`ConfigError` naming the file and the key.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mori.cli.options import BY_KEY, Option, OptionError, deprecation
from mori.traces import SHIPPED_TRACES


class ConfigError(ValueError):
    """A config file that cannot be read, or a key or value it should not have."""


def valid_keys(by_key: Mapping[str, Option] = BY_KEY) -> list[str]:
    """The keys a config file may set (those of ``by_key``), dashed, sorted."""
    return sorted(k.replace("_", "-") for k in by_key)


def load_config(path: Path, by_key: Mapping[str, Option] = BY_KEY) -> dict[str, Any]:
    """The option values set in the TOML file at ``path``, by option key (underscores);
    ``by_key`` is the command's option table (default: ``mori simulate``'s)."""
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        raise ConfigError("--config needs Python 3.11 or later (tomllib)") from None
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r}: no such file") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r}: not valid TOML: {e}") from None
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    former = {old: opt for opt in by_key.values() for old in opt.old}
    for name, value in raw.items():
        key = name.replace("-", "_")
        opt = by_key.get(key)
        if opt is None and key in former:
            opt = former[key]
            key = opt.key
            print(deprecation(f"config key {name!r} ({str(path)!r})",
                              repr(opt.key.replace("_", "-"))), file=sys.stderr)
        if opt is None:
            raise ConfigError(f"config file {str(path)!r}: unknown key {name!r}; valid keys: "
                              f"{', '.join(valid_keys(by_key))}")
        if key in values:
            raise ConfigError(f"config file {str(path)!r}: key {name!r} is set twice "
                              f"(also as {spelled[key]!r})")
        try:
            converted = opt.from_toml(value)
        except OptionError as e:
            raise ConfigError(f"config file {str(path)!r}: key {name!r}: {e}") from None
        if opt.kind is Path and not converted.is_absolute():
            beside = path.parent / converted
            if not (key == "traces" and not beside.exists()
                    and str(converted) in SHIPPED_TRACES):
                converted = beside
        values[key] = converted
        spelled[key] = name
    return values
