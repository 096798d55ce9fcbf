"""A scripted Model for the OpenAI Agents SDK (no LLM, no network), after the SDK's own tests' FakeModel.

Turn 1 calls one tool with fixed arguments; every later turn answers with a
message quoting the last tool output it was given, so a test can read what
the model saw (the tool's result, or the rejection's message).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from agents import Model, ModelResponse, Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)


class ScriptedModel(Model):
    def __init__(self, tool: str, arguments: dict[str, Any], call_id: str = "call_1") -> None:
        self.tool, self.arguments, self.call_id = tool, arguments, call_id
        self.seen_tool_outputs: list[str] = []

    async def get_response(self, system_instructions: str | None, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        items = input if isinstance(input, list) else []
        outputs = [i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
        if not outputs:
            call = ResponseFunctionToolCall(
                id="fc_1", call_id=self.call_id, name=self.tool, arguments=json.dumps(self.arguments), type="function_call",
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        last = str(outputs[-1].get("output"))
        self.seen_tool_outputs.append(last)
        text = ResponseOutputText(text=f"tool said: {last}", type="output_text", annotations=[])
        msg = ResponseOutputMessage(id="msg_1", content=[text], role="assistant", status="completed", type="message")
        return ModelResponse(output=[msg], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model is not streamed")
