"""A Gemini ``GenerateContentRequest`` checked and translated to an OpenAI chat body.

``to_chat(body, model, stream)`` returns the chat completion the engine gets, or raises
``RequestError`` (400) naming the Gemini field at fault (``contents[2].parts[0]``). The
mapping:

- ``systemInstruction`` (a ``Content``, or a string): a ``system`` message of its text.
- ``contents``: role ``user`` (or none, or the old ``function``) is the client's turn,
  ``model`` the model's. A user turn's ``text`` parts make a ``user`` message (image
  ``inlineData`` / ``fileData`` parts an ``image_url`` part of it), its
  ``functionResponse`` parts one ``tool`` message each, before it; a model turn is an
  ``assistant`` message: its text (``thought`` parts left out: an engine takes no
  reasoning back), its ``functionCall`` parts ``tool_calls``. A call's id is the
  client's (Gemini CLI keeps the ids the gateway gave it), else made from its place
  (``call_<turn>_<part>``); a response without an id answers the earliest unanswered
  call of its name. A response whose ``response`` is ``{"output": text}`` (Gemini
  CLI's) sends that text, any other its compact JSON.
- ``tools[].functionDeclarations``: chat ``function`` tools, the parameters from
  ``parametersJsonSchema`` (JSON Schema, as sent) or ``parameters`` (the API's OpenAPI
  subset: its upper-case types lower-cased, ``nullable`` as a ``"null"`` type). Tools the
  engine cannot run (``googleSearch``, ``codeExecution``, ...) are refused.
- ``toolConfig.functionCallingConfig.mode``: ``AUTO`` / ``ANY`` / ``NONE`` as
  ``tool_choice`` ``auto`` / ``required`` (a named function where ``ANY`` allows one) /
  ``none``.
- ``generationConfig``: ``temperature``, ``topP`` (``top_p``), ``topK`` (``top_k``, which
  vLLM and SGLang take), ``maxOutputTokens`` (``max_tokens``), ``stopSequences``
  (``stop``), ``seed``, ``presencePenalty`` / ``frequencyPenalty``, ``candidateCount``
  (1 only), ``responseMimeType`` ``application/json`` with ``responseJsonSchema`` /
  ``responseSchema`` (``response_format``). ``thinkingConfig``, ``safetySettings`` and
  the like have no chat counterpart and are left out.
- a stream asks for ``stream_options.include_usage``, so that its last event carries the
  usage (``usageMetadata``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mori.protocol.errors import RequestError

_TEXT_ROLES = ("user", "function")
_UNSERVED_TOOLS = ("googleSearch", "googleSearchRetrieval", "codeExecution", "urlContext",
                   "retrieval", "fileSearch", "googleMaps", "computerUse", "enterpriseWebSearch")
_META_KEYS = ("thought", "thoughtSignature", "videoMetadata", "partMetadata",
              "mediaResolution")
"""Part fields that say something of a part but hold no content of their own."""
_CHOICE = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto",
           "MODE_UNSPECIFIED": "auto"}


def _bad(where: str, rule: str) -> RequestError:
    return RequestError(400, f"invalid '{where}': {rule}", where)


def _obj(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(where, "must be an object")
    return value


def _num(value: Any, where: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(where, "must be a number")
    return value


def _int(value: Any, where: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(where, f"must be an integer of at least {low}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, "must be a string")
    return value


def compact(value: Any) -> str:
    """``value`` as compact JSON (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def system_text(value: Any, where: str = "systemInstruction") -> str:
    """The text of ``systemInstruction``: a string, or a ``Content``'s text parts."""
    if value is None or isinstance(value, str):
        return value or ""
    parts = _obj(value, where).get("parts")
    if not isinstance(parts, list):
        raise _bad(f"{where}.parts", "must be an array of parts")
    out = []
    for j, part in enumerate(parts):
        text = _obj(part, f"{where}.parts[{j}]").get("text")
        if text is not None:
            out.append(_str(text, f"{where}.parts[{j}].text"))
    return "\n".join(out)


def _media(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An image part (``inlineData`` base64, or ``fileData`` by URI) as a chat
    ``image_url`` part; anything else is refused."""
    if "inlineData" in part:
        blob = _obj(part["inlineData"], f"{where}.inlineData")
        mime = _str(blob.get("mimeType"), f"{where}.inlineData.mimeType")
        data = _str(blob.get("data"), f"{where}.inlineData.data")
        url = f"data:{mime};base64,{data}"
        kind = f"{where}.inlineData"
    else:
        ref = _obj(part["fileData"], f"{where}.fileData")
        mime = _str(ref.get("mimeType", "image/*"), f"{where}.fileData.mimeType")
        url = _str(ref.get("fileUri"), f"{where}.fileData.fileUri")
        kind = f"{where}.fileData"
    if not mime.startswith("image/"):
        raise _bad(kind, f"a {mime!r} part cannot be sent to the engine's chat API (only "
                   "images)")
    return {"type": "image_url", "image_url": {"url": url}}


def _response_text(response: Any) -> str:
    """What a function response tells the model: Gemini CLI's ``{"output": text}`` as
    its text, anything else as compact JSON."""
    if isinstance(response, Mapping) and set(response) == {"output"} \
            and isinstance(response["output"], str):
        return response["output"]
    return compact(response)


class _Calls:
    """The function calls of the conversation so far, to pair responses with."""

    def __init__(self) -> None:
        self.open: list[tuple[str, str]] = []  # (id, name), not answered yet

    def add(self, call_id: str, name: str) -> None:
        self.open.append((call_id, name))

    def answer(self, call_id: str | None, name: str, where: str) -> str:
        for i, (cid, cname) in enumerate(self.open):
            if (call_id is not None and cid == call_id) or (call_id is None and cname == name):
                del self.open[i]
                return cid
        if call_id is not None:
            return call_id  # a response to a call the conversation no longer holds
        raise _bad(where, f"answers no earlier functionCall named {name!r} (and has no 'id')")


def _user_turn(parts: list[Any], where: str, calls: _Calls) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    content: list[dict[str, Any]] = []
    for j, raw in enumerate(parts):
        pw = f"{where}.parts[{j}]"
        part = _obj(raw, pw)
        if "text" in part:
            if not part.get("thought"):
                content.append({"type": "text", "text": _str(part["text"], f"{pw}.text")})
        elif "functionResponse" in part:
            fr = _obj(part["functionResponse"], f"{pw}.functionResponse")
            name = _str(fr.get("name"), f"{pw}.functionResponse.name")
            fid = fr.get("id")
            if fid is not None:
                _str(fid, f"{pw}.functionResponse.id")
            response = _obj(fr.get("response", {}), f"{pw}.functionResponse.response")
            tools.append({"role": "tool", "tool_call_id": calls.answer(fid, name, pw),
                          "content": _response_text(response)})
        elif "inlineData" in part or "fileData" in part:
            content.append(_media(part, pw))
        elif "functionCall" in part:
            raise _bad(f"{pw}.functionCall", "only the model's turns (role 'model') call "
                       "functions")
        else:
            _no_content(part, pw)
    out = tools
    if content:
        text_only = all(c["type"] == "text" for c in content)
        out.append({"role": "user", "content": "\n".join(c["text"] for c in content)
                    if text_only else content})
    return out


def _model_turn(parts: list[Any], where: str, turn: int, calls: _Calls) -> dict[str, Any]:
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, raw in enumerate(parts):
        pw = f"{where}.parts[{j}]"
        part = _obj(raw, pw)
        if "text" in part:
            text = _str(part["text"], f"{pw}.text")
            if not part.get("thought"):
                texts.append(text)
        elif "functionCall" in part:
            fc = _obj(part["functionCall"], f"{pw}.functionCall")
            name = _str(fc.get("name"), f"{pw}.functionCall.name")
            args = _obj(fc.get("args", {}), f"{pw}.functionCall.args")
            fid = fc.get("id")
            call_id = _str(fid, f"{pw}.functionCall.id") if fid is not None \
                else f"call_{turn}_{j}"
            calls.add(call_id, name)
            tool_calls.append({"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": compact(args)}})
        elif "functionResponse" in part:
            raise _bad(f"{pw}.functionResponse", "function responses belong in a 'user' "
                       "turn")
        else:
            _no_content(part, pw)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    elif msg["content"] is None:
        msg["content"] = ""
    return msg


def _no_content(part: Mapping[str, Any], where: str) -> None:
    """A part with none of the content the translation takes: metadata alone is
    skipped, any other content refused."""
    other = [k for k in part if k not in _META_KEYS]
    if other:
        raise _bad(f"{where}.{other[0]}", "this kind of part cannot be sent to the "
                   "engine's chat API")


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of ``systemInstruction`` and ``contents`` (see the module doc)."""
    messages: list[dict[str, Any]] = []
    system = system_text(body.get("systemInstruction"))
    if system:
        messages.append({"role": "system", "content": system})
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise _bad("contents", "must be a non-empty array of contents")
    calls = _Calls()
    for i, raw in enumerate(contents):
        where = f"contents[{i}]"
        content = _obj(raw, where)
        role = content.get("role", "user")
        parts = content.get("parts")
        if not isinstance(parts, list):
            raise _bad(f"{where}.parts", "must be an array of parts")
        if role == "model":
            messages.append(_model_turn(parts, where, i, calls))
        elif role in _TEXT_ROLES:
            messages.extend(_user_turn(parts, where, calls))
        else:
            raise _bad(f"{where}.role", "must be 'user' or 'model'")
    return messages


def _schema(value: Any) -> Any:
    """The API's OpenAPI ``Schema`` as JSON Schema: upper-case types lower-cased,
    ``nullable`` as a ``"null"`` type, ``propertyOrdering`` left out."""
    if isinstance(value, list):
        return [_schema(v) for v in value]
    if not isinstance(value, Mapping):
        return value
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k in ("propertyOrdering", "nullable"):
            continue
        if k == "type" and isinstance(v, str):
            out[k] = v.lower()
        elif k in ("properties", "$defs", "definitions") and isinstance(v, Mapping):
            out[k] = {name: _schema(s) for name, s in v.items()}
        elif k in ("items", "anyOf", "oneOf", "allOf", "not", "additionalProperties"):
            out[k] = _schema(v)
        else:
            out[k] = v
    if value.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat ``tools`` of ``tools[].functionDeclarations`` (see the module doc)."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools", "must be an array of tools")
    out = []
    for i, raw in enumerate(tools):
        where = f"tools[{i}]"
        tool = _obj(raw, where)
        for key in tool:
            if key in _UNSERVED_TOOLS:
                raise _bad(f"{where}.{key}", "the engine behind this gateway runs no "
                           "built-in tools; declare functions instead")
        decls = tool.get("functionDeclarations", [])
        if not isinstance(decls, list):
            raise _bad(f"{where}.functionDeclarations", "must be an array")
        for j, rawd in enumerate(decls):
            dw = f"{where}.functionDeclarations[{j}]"
            decl = _obj(rawd, dw)
            fn: dict[str, Any] = {"name": _str(decl.get("name"), f"{dw}.name")}
            if decl.get("description") is not None:
                fn["description"] = _str(decl["description"], f"{dw}.description")
            if decl.get("parametersJsonSchema") is not None:
                params: Any = _obj(decl["parametersJsonSchema"], f"{dw}.parametersJsonSchema")
            elif decl.get("parameters") is not None:
                params = _schema(_obj(decl["parameters"], f"{dw}.parameters"))
            else:
                params = {"type": "object", "properties": {}}
            fn["parameters"] = params
            out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: Mapping[str, Any]) -> Any:
    cfg = body.get("toolConfig")
    if cfg is None:
        return None
    fcc = _obj(cfg, "toolConfig").get("functionCallingConfig")
    if fcc is None:
        return None
    fcc = _obj(fcc, "toolConfig.functionCallingConfig")
    mode = fcc.get("mode", "AUTO")
    if mode not in _CHOICE:
        raise _bad("toolConfig.functionCallingConfig.mode",
                   "must be one of " + ", ".join(_CHOICE))
    allowed = fcc.get("allowedFunctionNames")
    if mode == "ANY" and isinstance(allowed, list) and len(allowed) == 1:
        name = _str(allowed[0], "toolConfig.functionCallingConfig.allowedFunctionNames[0]")
        return {"type": "function", "function": {"name": name}}
    return _CHOICE[mode]


_SAMPLING = (("temperature", "temperature"), ("topP", "top_p"), ("topK", "top_k"),
             ("presencePenalty", "presence_penalty"),
             ("frequencyPenalty", "frequency_penalty"))


def _generation(cfg: Mapping[str, Any], chat: dict[str, Any]) -> None:
    """``generationConfig``'s fields that the chat API has (see the module doc)."""
    w = "generationConfig"
    for key, chat_key in _SAMPLING:
        if cfg.get(key) is not None:
            chat[chat_key] = _num(cfg[key], f"{w}.{key}")
    if cfg.get("maxOutputTokens") is not None:
        chat["max_tokens"] = _int(cfg["maxOutputTokens"], f"{w}.maxOutputTokens", 1)
    if cfg.get("seed") is not None:
        chat["seed"] = _int(cfg["seed"], f"{w}.seed", -(2 ** 63))
    if cfg.get("candidateCount") not in (None, 1):
        raise _bad(f"{w}.candidateCount", "only 1 candidate is served")
    stop = cfg.get("stopSequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad(f"{w}.stopSequences", "must be an array of strings")
        if stop:
            chat["stop"] = list(stop)
    mime = cfg.get("responseMimeType")
    if mime is not None and _str(mime, f"{w}.responseMimeType") == "application/json":
        schema = cfg.get("responseJsonSchema")
        if schema is None and cfg.get("responseSchema") is not None:
            schema = _schema(_obj(cfg["responseSchema"], f"{w}.responseSchema"))
        chat["response_format"] = {"type": "json_object"} if schema is None else {
            "type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def to_chat(body: Mapping[str, Any], model: str, stream: bool) -> dict[str, Any]:
    """The chat completion body for a Gemini ``GenerateContentRequest`` (see the module
    doc); ``RequestError`` (400) naming the field for a shape it cannot translate."""
    if body.get("cachedContent") is not None:
        raise _bad("cachedContent", "cached contents are not kept by this gateway; send "
                   "the contents themselves")
    chat: dict[str, Any] = {"model": model, "messages": chat_messages(body)}
    tools = chat_tools(body)
    choice = _tool_choice(body)
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
    cfg = body.get("generationConfig")
    if cfg is not None:
        _generation(_obj(cfg, "generationConfig"), chat)
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def count_request(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``GenerateContentRequest`` a ``countTokens`` body counts: its
    ``generateContentRequest``, else the body itself (``contents``)."""
    inner = body.get("generateContentRequest")
    return body if inner is None else _obj(inner, "generateContentRequest")
