"""A small tool-calling task for GRPO on a real instruct model: arithmetic through a calculator tool.

Each prompt asks for the sum or the product of two numbers. The system turn lists two tools, ``add``
and ``multiply`` (JSON schemas, rendered by the chat template), and one worked exchange shows the
call format: the user asks, the assistant answers with a ``<tool_call>`` (JSON name and arguments),
the tool returns, the assistant states the result. The policy's completion should be that one tool
call. The reward is computed here, by running the call:

- 0 if the completion holds no parsable ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  naming ``add`` or ``multiply`` with integer ``a`` and ``b``;
- 0.2 for such a call whose result (the tool run on its arguments) is wrong;
- 1.0 when the result equals the answer to the question.

SmolLM2-135M-Instruct never writes a tool call on its own; with the worked exchange it copies the
format some of the time and gets the numbers or the operation wrong often, so a group's rewards
differ and GRPO has something to learn from.
"""

from __future__ import annotations

import json
import random
import re

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{verb} two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name, verb in (("add", "Add"), ("multiply", "Multiply"))
]
RUN = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}
SYSTEM = "You are a calculator assistant. Answer each question with exactly one tool call."
QUESTIONS = {"add": ("What is {a} plus {b}?", "Add {a} and {b}."), "multiply": ("What is {a} times {b}?",)}
EXAMPLE = [  # the worked exchanges every prompt starts with
    message
    for question, name, a, b in (("What is 4 plus 9?", "add", 4, 9), ("What is 3 times 7?", "multiply", 3, 7))
    for message in (
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}],
        },
        {"role": "tool", "content": str(RUN[name](a, b))},
    )
]
# the prompt ends with the start of the call: the policy writes the tool name and the arguments
PREFILL = '<tool_call>\n{"name": "'
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def problems(n: int, seed: int = 0) -> list[dict]:
    """``n`` questions: ``{"messages": [...], "answer": int}`` (numbers 2..49, add or multiply)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        op = rng.choice(sorted(QUESTIONS))
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        question = rng.choice(QUESTIONS[op]).format(a=a, b=b)
        messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
        out.append({"messages": messages, "answer": RUN[op](a, b)})
    return out


def render(tokenizer, messages: list[dict]) -> str:
    """The prompt text: the chat template with the tools, the assistant header, then :data:`PREFILL`."""
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return text + PREFILL


def parse_call(text: str) -> tuple[str, dict] | None:
    """The first tool call of a completion as ``(name, arguments)``, or None if there is no valid one."""
    m = _CALL.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    if (
        not isinstance(call, dict)
        or call.get("name") not in RUN
        or not isinstance(call.get("arguments"), dict)
    ):
        return None
    args = call["arguments"]
    if set(args) != {"a", "b"} or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in args.values()
    ):
        return None
    return call["name"], args


def reward(completion: str, answer: int) -> float:
    """Run the tool call that :data:`PREFILL` + ``completion`` make: 1.0 if its result is the answer,
    0.2 if the call is valid but the result wrong, 0 without a valid call (see the module docstring)."""
    call = parse_call(PREFILL + completion)
    if call is None:
        return 0.0
    name, args = call
    return 1.0 if RUN[name](args["a"], args["b"]) == answer else 0.2
