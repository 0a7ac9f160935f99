"""Build the bundled sample (``src/treetrain/samples/``) from the tau-bench few-shot dialogues.

Usage::

    python scripts/make_sample.py [--src /work/shared/data/tau-bench-few-shot] [--out src/treetrain/samples]

Deterministic: the same dialogues, the same tokenizer (:func:`treetrain.data.qwen.qwen_tokenizer_dir`),
the same bytes. See the README written next to the samples for what each line holds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from treetrain.data.chat import load_tokenizer, per_turn
from treetrain.data.records import parse_record

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SRC = Path("/work/shared/data/tau-bench-few-shot")
DEFAULT_OUT = ROOT / "src" / "treetrain" / "samples"

# Short system prompts written for this sample (not tau-bench's policy documents).
SYSTEM = {
    "airline": (
        "You are a customer service agent for an airline. Help users book, modify or cancel flight "
        "reservations and answer questions about baggage, travel insurance and refunds. Before you "
        "change a reservation, authenticate the user (user ID and reservation ID), explain the change "
        "and get an explicit yes. Make one tool call at a time and never invent information. If a "
        "request is outside the airline's policy or you cannot help, transfer the user to a human agent."
    ),
    "retail": (
        "You are a customer service agent for an online retail store. Help users check, cancel or "
        "modify pending orders, return or exchange delivered items, and update their address or "
        "payment method. Authenticate the user first (email, or name and zip code), confirm every "
        "change with the user before acting, and make one tool call at a time. If you cannot help, "
        "transfer the user to a human agent."
    ),
}
# The dialogues show ``assistant: None`` for a tool call without its name or arguments.
PLACEHOLDER_CALL = {"type": "function", "function": {"name": "unknown_tool", "arguments": {}}}
ROLES = ("user", "assistant", "tool")


def parse_dialogue(display: str, domain: str) -> list[dict]:
    """tau-bench ``messages_display`` text -> OpenAI-style messages with a system prompt.

    A line starting with ``user: ``, ``assistant: `` or ``tool: `` opens a turn; any other line
    continues the previous one. ``assistant: None`` becomes a placeholder tool call; an assistant
    text turn directly followed by tool results gets one placeholder call per result.
    """
    turns: list[list] = []
    for line in display.split("\n"):
        role = next((r for r in ROLES if line.startswith(r + ": ")), None)
        if role is None:
            if not turns:
                raise ValueError(f"dialogue starts with a continuation line: {line[:60]!r}")
            turns[-1][1] += "\n" + line
        else:
            turns.append([role, line[len(role) + 2 :]])
    msgs: list[dict] = [{"role": "system", "content": SYSTEM[domain]}]
    for role, text in turns:
        if role == "assistant" and text == "None":
            msgs.append({"role": "assistant", "content": None, "tool_calls": []})
        elif role == "assistant":
            msgs.append({"role": "assistant", "content": text})
        else:
            msgs.append({"role": role, "content": text})
    # every tool result answers a call of the assistant message before the run of results
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        results = 0
        while i + 1 + results < len(msgs) and msgs[i + 1 + results]["role"] == "tool":
            results += 1
        calls = [dict(PLACEHOLDER_CALL) for _ in range(max(results, 1 if m["content"] is None else 0))]
        if calls:
            m["tool_calls"] = calls
        elif "tool_calls" in m:
            del m["tool_calls"]
    for i, m in enumerate(msgs):
        if m["role"] == "tool" and msgs[i - 1]["role"] not in ("assistant", "tool"):
            raise ValueError(f"tool result without a preceding assistant turn at message {i}")
    return msgs


def load_dialogues(src: Path) -> dict[str, list[list[dict]]]:
    out = {}
    for domain in ("airline", "retail"):
        lines = (src / f"{domain}.jsonl").read_text().splitlines()
        out[domain] = [parse_dialogue(json.loads(x)["messages_display"], domain) for x in lines if x.strip()]
    return out


def per_turn_record(msgs: list[dict], ident: str, source: str) -> dict:
    """(a) Each assistant turn its own path (the conversation up to it), loss on that turn only."""
    return {"id": ident, "meta": {"kind": "per-turn", "source": source}, "messages": per_turn(msgs)}


def group_record(msgs: list[dict], ident: str, source: str, group: int, target_por: float = 0.5) -> dict:
    """(b) ``group`` continuations of one shared prompt: the system prompt and the dialogue up to a
    user turn. Continuation ``g`` is the rest of the dialogue from the ``g``-th assistant turn after
    the prompt on: real text of the same conversation standing in for sampled rollouts. The cut is
    the user turn whose estimated POR (by characters) is nearest ``target_por``. Prompt assistant
    turns carry no loss."""
    msgs = trim_trailing(msgs)
    size = [len(json.dumps(m)) for m in msgs]

    def continuations(cut: int) -> list[int]:
        return [i for i in range(cut, len(msgs)) if msgs[i]["role"] == "assistant"][:group]

    def por(cut: int) -> float:
        prompt, rest = sum(size[:cut]), [sum(size[s:]) for s in continuations(cut)]
        return 1 - (prompt + sum(rest)) / (len(rest) * prompt + sum(rest))

    cuts = [i + 1 for i, m in enumerate(msgs) if m["role"] == "user" and i > 1]
    cuts = [c for c in cuts if len(continuations(c)) == group] or cuts
    cut = min(cuts, key=lambda c: abs(por(c) - target_por))
    prompt = [dict(m, weight=0) if m["role"] == "assistant" else m for m in msgs[:cut]]
    convs = [prompt + msgs[s:] for s in continuations(cut)]
    return {"id": ident, "meta": {"kind": "group", "source": source}, "messages": convs}


def trim_trailing(msgs: list[dict]) -> list[dict]:
    """Drop the messages after the last assistant turn (a final tool result has no loss)."""
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return msgs[: last + 1]


def to_paths(record: dict, tokenizer) -> dict:
    """A messages record -> the same sample in the paths format (through the data layer itself)."""
    tree, _ = parse_record(record, format="messages", tokenizer=tokenizer)
    masks = tree.fields["loss_masks"]
    return {
        "id": record["id"],
        "meta": record["meta"],
        "paths": [p.tolist() for p in tree.paths()],
        "loss_masks": [m.astype(int).tolist() for m in masks],
    }


# (domain, dialogue index in the source file) of each sample line, in file order
PER_TURN = [("airline", 16), ("retail", 32), ("airline", 18), ("retail", 44)]
GROUPS = [("airline", 8), ("retail", 47), ("airline", 12), ("retail", 14)]
GROUP_SIZE = 6
# the small messages-format sample (the CLI's messages path): short dialogues, readable
MESSAGES_PER_TURN = [("airline", 0)]
MESSAGES_GROUPS = [("airline", 9)]
MESSAGES_SINGLE = [("retail", 9)]
MESSAGES_GROUP_SIZE = 4


def build(src: Path, out: Path) -> list[str]:
    dialogues = load_dialogues(src)
    tok = load_tokenizer("qwen")

    def source(domain: str, k: int) -> str:
        return f"tau-bench few_shot_data {domain}.jsonl line {k + 1}"

    records = []
    for (d1, k1), (d2, k2) in zip(PER_TURN, GROUPS):  # interleave the two kinds
        records.append(per_turn_record(dialogues[d1][k1], f"{d1}-{k1:02d}/per-turn", source(d1, k1)))
        records.append(group_record(dialogues[d2][k2], f"{d2}-{k2:02d}/group", source(d2, k2), GROUP_SIZE))
    messages = [
        *(
            per_turn_record(dialogues[d][k], f"{d}-{k:02d}/per-turn", source(d, k))
            for d, k in MESSAGES_PER_TURN
        ),
        *(
            group_record(dialogues[d][k], f"{d}-{k:02d}/group", source(d, k), MESSAGES_GROUP_SIZE)
            for d, k in MESSAGES_GROUPS
        ),
        *(
            {
                "id": f"{d}-{k:02d}/sft",
                "meta": {"kind": "sft", "source": source(d, k)},
                "messages": dialogues[d][k],
            }
            for d, k in MESSAGES_SINGLE
        ),
    ]
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(to_paths(r, tok), separators=(",", ":")) for r in records]
    gz = out / "agent-dialogues.jsonl.gz"
    with open(gz, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as z:
        z.write(("\n".join(lines) + "\n").encode())
    with open(out / "agent-dialogues-messages.jsonl", "w") as f:
        for r in messages:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    shutil.copyfile(src / "LICENSE", out / "LICENSE")
    return [r["id"] for r in records]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", type=Path, default=DEFAULT_SRC, help="tau-bench few-shot directory")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    build(args.src, args.out)
    from treetrain.data.reader import iter_trees

    for name in ("agent-dialogues.jsonl.gz", "agent-dialogues-messages.jsonl"):
        path = args.out / name
        stream = iter_trees(path, tokenizer="qwen")
        for tree, info in stream:
            print(f"{name}:{info.line} {info.id:22s} {tree}")
        print(stream.counts.summary(), f"size {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
