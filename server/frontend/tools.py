"""Tool calls in DeepSeek-V3's format: the prompt side (tools described, earlier calls and results rendered)
and the output side (the model's call text parsed into calls, also incrementally while streaming).

DeepSeek-V3 writes a turn's calls as

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {ARGUMENTS}
    ```<｜tool▁call▁end｜>...more calls...<｜tool▁calls▁end｜>

and reads results back as <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>RESULT<｜tool▁output▁end｜>...
<｜tool▁outputs▁end｜>. The functions on offer go into a system message (the format above, then each
function's name, description and JSON-schema parameters). With tool_choice "required" or a named function,
decoding is constrained to exactly one call of the allowed functions with arguments valid for its schema
(the `tagged_json` kind of server/core/structured.py); with "auto" the output is parsed if it holds calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
ARGS_OPEN, ARGS_CLOSE = "\n```json\n", "\n```"


@dataclass
class Function:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments


def call_text(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}{ARGS_OPEN}{arguments}{ARGS_CLOSE}{CALL_END}"


def calls_text(calls: list[tuple[str, str]]) -> str:
    """An assistant turn's calls [(name, arguments JSON text)] as DeepSeek-V3 writes them."""
    return CALLS_BEGIN + "".join(call_text(n, a) for n, a in calls) + CALLS_END


def results_text(results: list[str]) -> str:
    return OUTPUTS_BEGIN + "".join(f"{OUTPUT_BEGIN}{r}{OUTPUT_END}" for r in results) + OUTPUTS_END


def system_prompt(functions: list[Function]) -> str:
    lines = ["You can call functions. To call one, answer with exactly:",
             f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}FUNCTION_NAME{ARGS_OPEN}ARGUMENTS_AS_JSON{ARGS_CLOSE}{CALL_END}"
             f"{CALLS_END}", "Functions:"]
    for f in functions:
        lines.append(json.dumps({"name": f.name, "description": f.description, "parameters": f.parameters}))
    return "\n".join(lines)


def constraint(functions: list[Function]) -> dict:
    """The structured_output spec for exactly one call of one of `functions` (arguments valid for its schema)."""
    return {"tagged_json": {"begin": CALLS_BEGIN, "end": CALLS_END, "options": [
        {"prefix": f"{CALL_BEGIN}function{SEP}{f.name}{ARGS_OPEN}", "schema": f.parameters or {"type": "object"},
         "suffix": ARGS_CLOSE + CALL_END} for f in functions]}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as generated
    id: str = field(default_factory=new_call_id)


def parse(text: str) -> tuple[str, list[ParsedCall]]:
    """(content before the calls, the calls) of a finished output; no calls if it holds no call block."""
    at = text.find(CALLS_BEGIN)
    if at == -1:
        return text, []
    calls = []
    for chunk in text[at + len(CALLS_BEGIN):].split(CALL_BEGIN)[1:]:
        head, _, rest = chunk.partition(SEP)
        name, _, args = rest.partition(ARGS_OPEN)
        args = args.split(CALL_END)[0]
        if args.endswith(ARGS_CLOSE):
            args = args[:-len(ARGS_CLOSE)]
        calls.append(ParsedCall(name.strip(), args))
    return text[:at], calls


class StreamParser:
    """Turns streamed text deltas into content deltas and tool-call events: ("content", text), ("call", index,
    id, name) once a call's name is complete, ("args", index, text) as its arguments arrive. Text that might be
    the start of a marker is held back until it is known not to be one."""

    def __init__(self):
        self.buffer = ""
        self.in_calls = False
        self.calls: list[ParsedCall] = []
        self._state = "between"  # in the call block: between | name | args
        self._sent_args = 0

    def feed(self, delta: str, final: bool = False) -> list[tuple]:
        self.buffer += delta
        events: list[tuple] = []
        while True:
            if not self.in_calls:
                at = self.buffer.find(CALLS_BEGIN)
                if at == -1:
                    keep = 0 if final else _partial_suffix(self.buffer, CALLS_BEGIN)
                    if len(self.buffer) > keep:
                        events.append(("content", self.buffer[:len(self.buffer) - keep]))
                        self.buffer = self.buffer[len(self.buffer) - keep:]
                    return events
                if at:
                    events.append(("content", self.buffer[:at]))
                self.buffer, self.in_calls = self.buffer[at + len(CALLS_BEGIN):], True
            elif self._state == "between":
                at = self.buffer.find(CALL_BEGIN)
                if at == -1:
                    return events
                self.buffer, self._state = self.buffer[at + len(CALL_BEGIN):], "name"
            elif self._state == "name":
                at = self.buffer.find(ARGS_OPEN)
                if at == -1:
                    return events
                name = self.buffer[:at].partition(SEP)[2].strip()
                self.calls.append(ParsedCall(name, ""))
                events.append(("call", len(self.calls) - 1, self.calls[-1].id, name))
                self.buffer, self._state, self._sent_args = self.buffer[at + len(ARGS_OPEN):], "args", 0
            else:  # args: everything up to the closing fence
                end = self.buffer.find(ARGS_CLOSE + CALL_END)
                upto = end if end != -1 else len(self.buffer) - (0 if final else
                                                                  _partial_suffix(self.buffer, ARGS_CLOSE + CALL_END))
                if upto > self._sent_args:
                    piece = self.buffer[self._sent_args:upto]
                    self.calls[-1].arguments += piece
                    events.append(("args", len(self.calls) - 1, piece))
                    self._sent_args = upto
                if end == -1:
                    return events
                self.buffer, self._state = self.buffer[end + len(ARGS_CLOSE + CALL_END):], "between"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
