"""The OpenHands SDK's agent as a command: ``python openhands_runner.py INSTRUCTION``, exit code 0 when it finished.

openhands-sdk ships no CLI (the ``openhands`` CLI on PyPI pins an older SDK), so polar_gym.harness.openhands writes
this file into the session's home and runs it with the pinned venv's python; it is not imported by polar_gym. It
builds what the SDK's ``get_default_agent(llm, cli_mode=True)`` builds (tools ``terminal``, ``file_editor``,
``task_tracker`` plus the built-in ``finish`` and ``think``; the summarizing condenser), with two changes: the
terminal is the ``subprocess`` backend (bash on a pty; the default picks tmux when it is installed, and its server
would outlive the run), and the condenser's LLM gets the side model's name, so the proxy flags its calls. Retries
are cut from five (8 to 64 s apart) to two, so a gateway that is gone ends the run in seconds.

Settings come from the environment the adapter sets: POLAR_OH_MODEL and POLAR_OH_SIDE_MODEL (litellm names with
their provider prefix), POLAR_OH_BASE_URL, POLAR_OH_API_KEY, POLAR_OH_API_MODE (chat, responses), and
POLAR_OH_MAX_ITERATIONS; POLAR_OH_CONVERSATIONS is where the conversation's events are kept.
"""

from __future__ import annotations

import os
import sys

from openhands.sdk import LLM, Agent, Conversation, Tool  # type: ignore[import-not-found]
from openhands.sdk.context.condenser import default_condenser  # type: ignore[import-not-found]
from openhands.sdk.conversation.state import ConversationExecutionStatus  # type: ignore[import-not-found]
from openhands.tools.file_editor import FileEditorTool  # type: ignore[import-not-found]
from openhands.tools.task_tracker import TaskTrackerTool  # type: ignore[import-not-found]
from openhands.tools.terminal import TerminalTool  # type: ignore[import-not-found]


def main(instruction: str) -> int:
    llm = LLM(model=os.environ["POLAR_OH_MODEL"], base_url=os.environ["POLAR_OH_BASE_URL"],
              api_key=os.environ["POLAR_OH_API_KEY"], api_mode=os.environ.get("POLAR_OH_API_MODE", "chat"),
              usage_id="agent", num_retries=2, retry_min_wait=1, retry_max_wait=4)
    condenser_llm = llm.model_copy(update={"model": os.environ["POLAR_OH_SIDE_MODEL"], "usage_id": "condenser"})
    agent = Agent(llm=llm, tools=[Tool(name=TerminalTool.name, params={"terminal_type": "subprocess"}),
                                  Tool(name=FileEditorTool.name), Tool(name=TaskTrackerTool.name)],
                  system_prompt_kwargs={"cli_mode": True}, condenser=default_condenser(condenser_llm))
    conversation = Conversation(agent=agent, workspace=os.getcwd(), visualizer=None,
                                persistence_dir=os.environ.get("POLAR_OH_CONVERSATIONS") or None,
                                max_iteration_per_run=int(os.environ.get("POLAR_OH_MAX_ITERATIONS", "100")))
    try:
        conversation.send_message(instruction)
        conversation.run()
        status = conversation.state.execution_status
    finally:
        conversation.close()
    print(f"openhands: the conversation ended {status.value}", file=sys.stderr)
    return 0 if status == ConversationExecutionStatus.FINISHED else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
