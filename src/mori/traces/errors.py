"""Trace input errors, and typed access to parsed JSON that raises them.

Every problem found while reading a trace file is a :class:`TraceError`; its message
always names the file and the place at fault (a JSONL line, a JSON field path such as
``requests[12].in``, or both), says what was wrong, and how to fix it when that is obvious.
"""

from __future__ import annotations

import math
import os


class TraceError(ValueError):
    """A trace file that cannot be read or does not follow its format.

    ``file``: the file (or directory) as given; ``where``: the line and/or field path
    ("line 4: steps[2].gap_s", "requests[12].in"), or ``None`` for the file as a whole;
    ``problem``: what was wrong; ``hint``: how to fix it, or ``None``.
    ``str(err)`` is ``"<file>: <where>: <problem>; <hint>"`` (absent parts left out).
    """

    def __init__(
        self,
        file: str | os.PathLike[str],
        where: str | None,
        problem: str,
        hint: str | None = None,
    ) -> None:
        self.file = os.fspath(file)
        self.where = where or None
        self.problem = problem
        self.hint = hint
        parts = [self.file] + ([self.where] if self.where else []) + [problem]
        message = ": ".join(parts)
        super().__init__(f"{message}; {hint}" if hint else message)

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, str | None, str, str | None]]:
        return (type(self), (self.file, self.where, self.problem, self.hint))


def _type_name(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer"}
    if value is None:
        return "null"
    return names.get(type(value), "number" if isinstance(value, float) else type(value).__name__)


class Fields:
    """Validated, typed access to the fields of one parsed JSON object.

    ``value`` must be a JSON object (a ``dict``), else :class:`TraceError`. ``where`` is
    the object's field path (``"requests[3]"``, ``"steps[0].subagents[1].program"``; ``""``
    for the top level) and ``line`` the JSONL line it came from, if any. A field's location
    is ``where + "." + key``, prefixed by ``"line N: "`` when ``line`` is given. Required
    getters raise on a missing or ``null`` field; ``opt_*`` getters return ``None`` for
    both; a ``default`` replaces a missing or ``null`` field. Integers must
    be JSON integers (not booleans), numbers finite; both must be non-negative.
    """

    def __init__(
        self, value: object, file: str | os.PathLike[str], where: str, line: int | None = None
    ) -> None:
        self.file = os.fspath(file)
        self.where = where
        self.line = line
        if not isinstance(value, dict):
            raise self.error(f"expected a JSON object, got {_type_name(value)}")
        self._obj: dict[str, object] = value

    def child(self, value: object, where: str) -> Fields:
        """A nested object of the same file (and line) at field path ``where``."""
        return Fields(value, self.file, where, self.line)

    def path(self, key: str) -> str:
        """The field path of field ``key`` of this object."""
        return f"{self.where}.{key}" if self.where else key

    def error(self, problem: str, key: str | None = None, hint: str | None = None) -> TraceError:
        """A :class:`TraceError` located at this object, or at its field ``key``."""
        where = self.path(key) if key else self.where
        if self.line is not None:
            where = f"line {self.line}: {where}" if where else f"line {self.line}"
        return TraceError(self.file, where, problem, hint)

    def field_names(self) -> list[str]:
        """The object's field names, in order."""
        return list(self._obj)

    def peek(self, key: str) -> object:
        """Field ``key`` unchecked, ``None`` when missing (for error recovery)."""
        return self._obj.get(key)

    def has(self, key: str) -> bool:
        """Whether field ``key`` is present and not ``null``."""
        return self._obj.get(key) is not None

    def raw(self, key: str) -> object:
        """Field ``key`` unchecked; :class:`TraceError` if missing or ``null``."""
        value = self._obj.get(key)
        if value is None:
            problem = f"field '{key}' is null" if key in self._obj else f"missing field '{key}'"
            raise self.error(problem)
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        """A non-negative integer field; ``default`` (when given) if absent."""
        if default is not None and not self.has(key):
            return default
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"expected a non-negative integer, got {_type_name(value)}", key)
        if value < 0:
            raise self.error(f"must not be negative, got {value}", key)
        return value

    def number(self, key: str, default: float | None = None) -> float:
        """A finite non-negative number field; ``default`` (when given) if absent."""
        if default is not None and not self.has(key):
            return default
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"expected a non-negative number, got {_type_name(value)}", key)
        number = float(value)
        if not math.isfinite(number):
            raise self.error(f"must be finite, got {value}", key)
        if number < 0:
            raise self.error(f"must not be negative, got {value}", key)
        return number

    def opt_number(self, key: str) -> float | None:
        """Like :meth:`number`, but ``None`` when absent."""
        return self.number(key) if self.has(key) else None

    def text(self, key: str, default: str | None = None) -> str:
        """A string field; ``default`` (when given) if absent."""
        if default is not None and not self.has(key):
            return default
        value = self.raw(key)
        if not isinstance(value, str):
            raise self.error(f"expected a string, got {_type_name(value)}", key)
        return value

    def opt_text(self, key: str) -> str | None:
        """Like :meth:`text`, but ``None`` when absent."""
        return self.text(key) if self.has(key) else None

    def array(self, key: str, default: list[object] | None = None) -> list[object]:
        """An array field; ``default`` (when given) if absent."""
        if default is not None and not self.has(key):
            return default
        value = self.raw(key)
        if not isinstance(value, list):
            raise self.error(f"expected an array, got {_type_name(value)}", key)
        return value
