"""One streamed chat choice's tool calls (:mod:`gateway.tools`), as OpenAI streams them.

A named function's call opens with its id and name and then grows by argument deltas as tokens
come; ``"required"`` calls are sent whole when the answer ends, since a call in the middle of the
JSON array is not yet known to be one (their tokens' log-probabilities still stream as they come).
Under ``"auto"`` the answer's first character other than white space decides: ``[`` opens calls
(sent whole at the end), anything else is text, streamed as content as it comes.
"""

from __future__ import annotations

from gateway.protocol import ChatDelta
from gateway.tools import FunctionCallDelta, ToolCallDelta, ToolCalling, call_id, opens_calls


class ToolCallStream:
    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self._text: list[str] = []
        self._opened = False
        self._content: bool | None = None if calling.auto else False  # auto: text or calls, not yet known

    def delta(self, text: str) -> ChatDelta:
        """The delta that carries a piece of the answer's text."""
        self._text.append(text)
        if self._content is None and text.strip():
            self._content = not opens_calls("".join(self._text))
            if self._content:  # with the white space held so far
                return ChatDelta(content="".join(self._text))
        if self._content:
            return ChatDelta(content=text)
        if self.calling.forced is None:
            return ChatDelta()  # held until the end
        if not self._opened:
            self._opened = True
            function = FunctionCallDelta(name=self.calling.forced, arguments=text)
            return ChatDelta(tool_calls=[ToolCallDelta(index=0, id=call_id(), type="function", function=function)])
        return ChatDelta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))])

    def finish(self, reason: str) -> tuple[ChatDelta | None, str]:
        """The last delta (None: nothing left to send) and the finish reason OpenAI gives."""
        if self._content:  # text, streamed already
            return None, reason
        if self._content is None:  # white space, or nothing
            return ChatDelta(content="".join(self._text)) if "".join(self._text) else None, reason
        text = "".join(self._text)
        if self.calling.forced is not None:
            opened = None if self._opened else self.delta("")
            return opened, self.calling.finish_reason if reason == "stop" else reason
        calls = self.calling.calls(text) if reason == "stop" else None
        if calls is None:  # cut short: the text, as content, is all there is
            return ChatDelta(content=text), reason
        deltas = [ToolCallDelta(index=j, id=call.id, type="function",
                                function=FunctionCallDelta(name=call.function.name, arguments=call.function.arguments))
                  for j, call in enumerate(calls)]
        return ChatDelta(tool_calls=deltas), self.calling.finish_reason
