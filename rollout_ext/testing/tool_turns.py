"""A multi-turn tool conversation for models that cannot call tools (test-only).

verl's ToolAgentLoop continues a conversation only when its tool parser finds a call in the model's
answer. A tiny or random-weight model never writes one, so `always_call` (a ToolParser, registered
under PARSER when this module is imported) reads every answer as one call to the tool `note`
(verl's BaseTool, which answers every call with a fixed text). With
`rollout.multi_turn.format=always_call` and `max_assistant_turns=N`, every conversation runs N
turns through the rollout client and router, as a real tool-using policy's would.
"""

from __future__ import annotations

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema

PARSER = "always_call"
TOOL = "note"


@ToolParser.register(PARSER)
class AlwaysCallParser(ToolParser):
    async def extract_tool_calls(self, responses_ids, tools=None):
        return self.tokenizer.decode(responses_ids), [FunctionCall(name=TOOL, arguments="{}")]


def note_tool() -> BaseTool:
    schema = OpenAIFunctionToolSchema.model_validate({
        "type": "function",
        "function": {"name": TOOL, "description": "Keep a note.",
                     "parameters": {"type": "object", "properties": {}, "required": []}},
    })
    return BaseTool({}, schema)
