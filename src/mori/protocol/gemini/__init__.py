"""The Gemini API (``generateContent``, ``streamGenerateContent``, ``countTokens``), served
by translating to and from the engines' OpenAI chat completions.

Gemini CLI and the ``google-genai`` SDKs speak it: ``POST
/v1beta/models/<model>:<method>`` (``/v1/models/...`` too), the model named in the path,
the key in ``x-goog-api-key``. The gateway reads such a request as the client sent it
(its program, its tool results: ``contents``) and sends the engine a chat completion;
the engine's answer comes back to the client in the Gemini API's shape.

- ``routes``: the paths (``gemini_route``) and the method of each.
- ``errors``: the Gemini API's error body and stream event.
- ``request``: a ``GenerateContentRequest`` checked and translated to a chat body
  (``to_chat``; a ``RequestError`` 400 naming the field for a wrong shape).
- ``contents``: what a conversation says for program identity (its head, its turns,
  whether it returns tool results).
- ``response``: a chat completion translated to a ``GenerateContentResponse``.
- ``stream``: a chat completion stream translated, event by event, to an SSE stream of
  ``GenerateContentResponse`` chunks.

Written here, not taken from a library: the translation is a few hundred lines of
mapping between two JSON shapes, and the libraries that do it (litellm's proxy) bring a
server and a dependency tree of their own for what the gateway needs of them.
"""
