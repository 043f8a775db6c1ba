"""The Gemini API's paths: ``/v1beta/models/<model>:<method>`` (and ``/v1/...``).

The model is everything between ``models/`` and the last ``:`` (a served model such as
``Qwen/Qwen3-8B`` keeps its slash); the methods served are ``METHODS``. ``PATHS`` names
each for metrics and docs."""

from __future__ import annotations

from dataclasses import dataclass

PREFIXES = ("/v1beta/models/", "/v1/models/")
"""Where a Gemini API method's path starts (the SDKs' default is ``v1beta``)."""
GENERATE = "generateContent"
STREAM = "streamGenerateContent"
COUNT = "countTokens"
METHODS = (GENERATE, STREAM, COUNT)
PATHS = {m: f"/v1beta/models/{{model}}:{m}" for m in METHODS}
"""Each method's path as metrics and docs name it (one label, whatever the model)."""


@dataclass(frozen=True, slots=True)
class GeminiRoute:
    """A Gemini API path read: the ``model`` it names and its ``method`` (one of
    ``METHODS``, or another the gateway does not serve)."""

    model: str
    method: str


def is_gemini_path(path: str) -> bool:
    """Whether ``path`` (no query string) is under the Gemini API's model paths."""
    return path.startswith(PREFIXES)


def gemini_route(path: str) -> GeminiRoute | None:
    """The model and method of a Gemini API path; None for any other path, or one that
    names no model or no method."""
    for prefix in PREFIXES:
        if path.startswith(prefix):
            model, sep, method = path[len(prefix):].rpartition(":")
            if sep and model and method:
                return GeminiRoute(model, method)
            return None
    return None
