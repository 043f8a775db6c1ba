"""An agent built on the openai-agents SDK, as its users write one: one ``Agent`` with a
function tool that runs ``sleep SECONDS``, run once by ``Runner.run_sync``.

    python tests/agents/openai_agents_client.py BASE_URL MODEL API [SECONDS]

``BASE_URL`` ends in ``/v1``; ``API`` is ``responses`` (the SDK's default model class,
``OpenAIResponsesModel``) or ``chat`` (``OpenAIChatCompletionsModel``). Tracing is off
(the SDK would otherwise send its traces to OpenAI). Prints the run's final output.
"""

from __future__ import annotations

import subprocess
import sys

from openai import AsyncOpenAI

# the openai-agents SDK (ruff sorts it as this repository's own tests/agents package; run
# as a script, this file imports the installed SDK)
from agents import (
    Agent,
    Model,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

TOOL = "wait_a_while"
"""The function tool's name (what a script calls)."""


def build(base_url: str, model_name: str, api: str, seconds: float) -> Agent:
    client = AsyncOpenAI(base_url=base_url, api_key="mori-local-key", max_retries=0)
    model: Model
    if api == "responses":
        model = OpenAIResponsesModel(model=model_name, openai_client=client)
    elif api == "chat":
        model = OpenAIChatCompletionsModel(model=model_name, openai_client=client)
    else:
        raise SystemExit(f"API must be 'responses' or 'chat', not {api!r}")

    @function_tool(name_override=TOOL)
    def wait_a_while(reason: str) -> str:
        """Wait a while before going on.

        Args:
            reason: why to wait.
        """
        subprocess.run(["sleep", f"{seconds:g}"], check=True)
        return f"waited {seconds:g} s ({reason})"

    return Agent(name="waiter", instructions="Wait when asked, then say you are done.",
                 tools=[wait_a_while], model=model)


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    seconds = float(argv[3]) if len(argv) == 4 else 2.0
    set_tracing_disabled(True)
    result = Runner.run_sync(build(argv[0], argv[1], argv[2], seconds), "Wait a while.")
    print(result.final_output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
