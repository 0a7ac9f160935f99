"""A small synthetic GUI-agent data set: screenshots drawn here with PIL, conversations as OpenAI chat.

    python examples/gui_agent_sample.py                      # writes examples/data/gui_agent/
    python examples/gui_agent_sample.py --out DIR --seed 0   # elsewhere (same seed: same bytes)

Writes ``DIR/gui_agent.jsonl`` (one record per task, several sampled conversations each) and
``DIR/screens/*.png`` (one file per distinct screenshot, 56x56 to 112x84 pixels, so tiny models
run fast). Everything is drawn from rectangles and PIL's built-in bitmap font: no third-party
artwork, license-clean, deterministic for a seed.

Each record is one task with the two tools ``click`` (``x``, ``y``: a pixel of the screen) and
``type_text`` (``text``: typed into the focused field) declared in its ``tools`` field. A
conversation is a system prompt, the user's task with the first screenshot, then assistant tool
calls, each answered by a ``tool`` message whose content is a list of parts: a line of text and
the screenshot after the action::

    {"role": "tool", "tool_call_id": "call_2", "content": [
        {"type": "text", "text": "Typed 'alice'."},
        {"type": "image_url", "image_url": {"url": "screens/login-02.png"}}]}

(image URLs are paths relative to the JSONL file). Per-path ``rewards`` say which samples did the
task. The records:

- ``login``: four samples of one task. They share the system prompt, the task and its screenshot;
  one clicks Cancel first; the other three click the user field and, after that screenshot, branch:
  one mistypes the user name, two type it right and differ at the password (``1234`` and ``1243``:
  their masked screenshots are the same pixels, saved once, though after different calls);
- ``search``: three samples of a file search (click the field, type, click Go or press the wrong
  button);
- ``refresh``: two samples whose text is identical, but whose screenshot after "Refresh" differs
  (the inbox changed between the two rollouts): they share everything up to that screenshot and
  must not merge after it;
- ``dialog``: a 56x56 dialog, two samples (OK, or a click beside it).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "Click the screen at pixel (x, y); (0, 0) is the top left corner.",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "type_text",
            "description": "Type text into the focused field.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    },
]
SYSTEM = (
    "You operate a computer through screenshots. Each turn call one tool: click(x, y) on a pixel of "
    "the latest screenshot, or type_text(text) into the focused field. Answer in text when done."
)
FONT = ImageFont.load_default_imagefont()  # PIL's bitmap font: the same pixels everywhere

# ---- drawing -----------------------------------------------------------------------------------


class Screen:
    """A screenshot being drawn: a desktop, then windows, fields, buttons and text on it."""

    def __init__(self, size: tuple[int, int], desktop: tuple[int, int, int]):
        self.image = Image.new("RGB", size, desktop)
        self.draw = ImageDraw.Draw(self.image)

    def window(self, box, title: str):
        x0, y0, x1, y1 = box
        self.draw.rectangle(box, fill=(236, 236, 236), outline=(90, 90, 90))
        self.draw.rectangle((x0, y0, x1, y0 + 11), fill=(40, 70, 150))
        self.draw.text((x0 + 3, y0 + 1), title, fill=(255, 255, 255), font=FONT)
        self.draw.rectangle((x1 - 9, y0 + 2, x1 - 2, y0 + 9), fill=(200, 60, 60))  # close box

    def field(self, box, text: str = "", focused: bool = False):
        self.draw.rectangle(box, fill=(255, 255, 255), outline=(40, 110, 220) if focused else (150, 150, 150))
        self.draw.text((box[0] + 2, box[1] + 1), text, fill=(0, 0, 0), font=FONT)
        if focused:  # the text cursor after the text
            x = box[0] + 3 + int(FONT.getlength(text))
            self.draw.line((x, box[1] + 2, x, box[3] - 2), fill=(0, 0, 0))

    def button(self, box, label: str, primary: bool = False):
        self.draw.rectangle(box, fill=(60, 130, 220) if primary else (205, 205, 205), outline=(80, 80, 80))
        w = FONT.getlength(label)
        self.draw.text(((box[0] + box[2] - w) / 2, box[1] + 1), label, fill=(0, 0, 0), font=FONT)

    def text(self, xy, text: str, color=(0, 0, 0)):
        self.draw.text(xy, text, fill=color, font=FONT)


def center(box) -> dict:
    return {"x": (box[0] + box[2]) // 2, "y": (box[1] + box[3]) // 2}


class Screens:
    """Saves each distinct screenshot once, under ``screens/NAME.png``; the same pixels drawn again
    (the same screen state reached by two samples) give the file saved first."""

    def __init__(self, out: Path):
        self.dir = out / "screens"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.by_pixels: dict[str, str] = {}

    def save(self, screen: Screen, name: str) -> str:
        digest = hashlib.sha256(screen.image.tobytes() + repr(screen.image.size).encode()).hexdigest()
        if digest not in self.by_pixels:
            buf = io.BytesIO()
            screen.image.save(buf, format="PNG", optimize=True)
            (self.dir / f"{name}.png").write_bytes(buf.getvalue())
            self.by_pixels[digest] = f"screens/{name}.png"
        return self.by_pixels[digest]


# ---- conversations -----------------------------------------------------------------------------


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


class Conversation:
    """One sampled conversation: the task with its first screenshot, then calls and results."""

    def __init__(self, task: str, first_screen: str):
        content = [{"type": "text", "text": task}, image_part(first_screen)]
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
        self.calls = 0

    def act(self, name: str, arguments: dict, result: str, screen: str, say: str | None = None):
        """The assistant calls ``name`` (with a line of text ``say``, or none); the tool answers with
        ``result`` and the screenshot after the action."""
        self.calls += 1
        call_id = f"call_{self.calls}"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        self.messages.append({"role": "assistant", "content": say, "tool_calls": [call]})
        content = [{"type": "text", "text": result}, image_part(screen)]
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        return self

    def click(self, box, screen: str, say: str | None = None):
        xy = center(box)
        return self.act("click", xy, f"Clicked at ({xy['x']}, {xy['y']}).", screen, say)

    def type(self, text: str, screen: str):
        return self.act("type_text", {"text": text}, f"Typed {text!r}.", screen)

    def answer(self, text: str):
        self.messages.append({"role": "assistant", "content": text})
        return self.messages


def record(rid: str, conversations: list[list[dict]], rewards: list[float]) -> dict:
    return {"id": rid, "tools": TOOLS, "messages": conversations, "rewards": rewards}


# ---- the tasks ---------------------------------------------------------------------------------


def login(screens: Screens, rng: random.Random) -> dict:
    size, desktop = (112, 84), tuple(rng.randrange(40, 120) for _ in range(3))
    win, user, pw = (2, 2, 109, 81), (40, 18, 104, 29), (40, 34, 104, 45)
    ok, cancel = (58, 60, 104, 73), (8, 60, 52, 73)

    def shot(name, u="", p="", focus=None, note=None, closed=False):
        s = Screen(size, desktop)
        if not closed:
            s.window(win, "Sign in")
            s.text((6, 19), "User", (40, 40, 40))
            s.text((6, 35), "Pass", (40, 40, 40))
            s.field(user, u, focus == "user")
            s.field(pw, "*" * len(p), focus == "pw")
            s.button(cancel, "Cancel")
            s.button(ok, "Log in", primary=True)
            if note:
                s.text((8, 48), note, (190, 30, 30))
        else:
            s.text((4, 4), note or "", (255, 255, 255))
        return screens.save(s, name)

    task = "Sign in as alice with the password 1234."
    first = shot("login-00")
    user_focused = shot("login-01", focus="user")

    def typed_user(c: Conversation, name: str) -> Conversation:
        c.click(user, user_focused, "I will click the user field first.")
        return c.type(name, shot(f"login-02-{name}", u=name, focus="user"))

    right, wrong_pw, typo = (typed_user(Conversation(task, first), n) for n in ("alice", "alice", "alcie"))
    for c, password in ((right, "1234"), (wrong_pw, "1243")):
        c.click(pw, shot("login-03", u="alice", focus="pw"))
        c.type(password, shot("login-04", u="alice", p=password, focus="pw"))  # masked: one file
    right.click(ok, shot("login-05-welcome", closed=True, note="Welcome, alice"))
    wrong_pw.click(ok, shot("login-05-denied", u="alice", note="Wrong password"))
    typo.click(pw, shot("login-03-alcie", u="alcie", focus="pw"))
    typo.type("1234", shot("login-04-alcie", u="alcie", p="1234", focus="pw"))
    typo.click(ok, shot("login-05-unknown", u="alcie", note="Unknown user"))
    cancelled = Conversation(task, first).click(cancel, shot("login-01-closed", closed=True))
    return record(
        "login",
        [
            right.answer("Signed in as alice."),
            wrong_pw.answer("The password was rejected."),
            typo.answer("The sign-in failed: unknown user."),
            cancelled.answer("The sign-in window closed."),
        ],
        [1.0, 0.0, 0.0, 0.0],
    )


def search(screens: Screens, rng: random.Random) -> dict:
    size, desktop = (112, 112), tuple(rng.randrange(40, 120) for _ in range(3))
    box, go, clear = (6, 16, 70, 27), (74, 16, 106, 27), (74, 96, 106, 108)
    names = ["notes", "photo", "report", "budget", "todo"]
    rng.shuffle(names)

    def shot(name, query="", focus=False, results=None):
        s = Screen(size, desktop)
        s.window((1, 1, 110, 110), "Files")
        s.field(box, query, focus)
        s.button(go, "Go", primary=True)
        s.button(clear, "Clear")
        for i, n in enumerate(names if results is None else results):
            s.text((8, 32 + 12 * i), n, (30, 30, 30))
        return screens.save(s, name)

    task = "Find the file named report."
    first, focused = shot("search-00"), shot("search-01", focus=True)
    typed = shot("search-02", "report", focus=True)
    found = shot("search-03", "report", results=["report"])
    cleared = shot("search-03-cleared")
    go_ok = Conversation(task, first).click(box, focused).type("report", typed)
    go_ok.click(go, found, "Now I press Go.")
    go_again = Conversation(task, first).click(box, focused).type("report", typed).click(go, found)
    wrong = Conversation(task, first).click(box, focused).type("report", typed).click(clear, cleared)
    return record(
        "search",
        [
            go_ok.answer("The file report is listed."),
            go_again.answer("Found it: report."),
            wrong.answer("The search was cleared; nothing is listed."),
        ],
        [1.0, 1.0, 0.0],
    )


def refresh(screens: Screens, rng: random.Random) -> dict:
    """Identical text, different pixels: the inbox after Refresh differs between the two rollouts."""
    size, desktop = (112, 84), tuple(rng.randrange(40, 120) for _ in range(3))
    button = (60, 15, 106, 26)

    def shot(name, rows):
        s = Screen(size, desktop)
        s.window((2, 2, 109, 81), "Mail")
        s.button(button, "Refresh")
        for i, (sender, unread) in enumerate(rows):
            s.text((6, 30 + 11 * i), sender, (0, 0, 0) if unread else (120, 120, 120))
        return screens.save(s, name)

    senders = ["ana", "bob", "chen", "dev"]
    before = [(n, False) for n in senders[:2]]
    first = shot("refresh-00", before)
    after = [shot(f"refresh-01-{k}", [(senders[2 + k], True), *before]) for k in range(2)]
    task = "Refresh the inbox."
    paths = [Conversation(task, first).click(button, a).answer("The inbox is refreshed.") for a in after]
    return record("refresh", paths, [1.0, 1.0])


def dialog(screens: Screens, rng: random.Random) -> dict:
    size, desktop = (56, 56), tuple(rng.randrange(40, 120) for _ in range(3))
    ok = (16, 36, 40, 48)
    s = Screen(size, desktop)
    s.window((3, 8, 52, 52), "Note")
    s.text((7, 22), "Saved.", (0, 0, 0))
    s.button(ok, "OK", primary=True)
    first = screens.save(s, "dialog-00")
    closed = screens.save(Screen(size, desktop), "dialog-01-closed")
    task = "Close the dialog."
    good = Conversation(task, first).click(ok, closed).answer("Closed.")
    beside = Conversation(task, first).click((4, 53, 8, 55), first).answer("The dialog is still open.")
    return record("dialog", [good, beside], [1.0, 0.0])


def write_sample(out: str | Path, seed: int = 0) -> Path:
    """Draw the screenshots and write ``out/gui_agent.jsonl``; returns that file's path."""
    out = Path(out)
    screens, rng = Screens(out), random.Random(seed)
    records = [task(screens, rng) for task in (login, search, refresh, dialog)]
    path = out / "gui_agent.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def qwen_vl_template() -> str:
    """treetrain's Qwen chat template with content given as parts: an ``image`` part renders as Qwen-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``, a ``text`` part as its text."""
    from treetrain.data.qwen import QWEN_CHAT_TEMPLATE

    text_only = "{%- else %}\n        {%- set content = '' %}"
    parts = (
        "{%- else %}\n        {%- set acc = namespace(s='') %}"
        "{%- for c in message.content %}{%- if c.type == 'image' %}"
        "{%- set acc.s = acc.s + '<|vision_start|><|image_pad|><|vision_end|>' %}"
        "{%- elif c.type == 'text' %}{%- set acc.s = acc.s + c.text %}{%- endif %}{%- endfor %}"
        "{%- set content = acc.s %}"
    )
    assert QWEN_CHAT_TEMPLATE.count(text_only) == 1
    return QWEN_CHAT_TEMPLATE.replace(text_only, parts)


def write_tiny_model(out: str | Path, seed: int = 0) -> Path:
    """A tiny random-init Qwen2-VL (2 layers of 64, a 1-layer vision tower of 32; 14-pixel patches,
    2x2 merge: a 112x112 screenshot is 16 tokens) with the offline Qwen tokenizer, the template of
    :func:`qwen_vl_template` and Qwen2-VL's image processor (PIL): a model directory for trying the
    sample with ``treetrain`` and no download. Not a trained model: its replies are noise."""
    import torch
    import transformers

    from treetrain.data.chat import load_tokenizer

    out = Path(out)
    tok = load_tokenizer("qwen")
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>")}
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2)
    cfg = transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.Qwen2VLForConditionalGeneration(cfg).save_pretrained(out)
    tok.chat_template = qwen_vl_template()
    tok.save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=28 * 28, max_pixels=256 * 256
    ).save_pretrained(out)
    return out


def main(argv=None) -> int:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(here / "data" / "gui_agent"), help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="desktop colors and list order (default 0)")
    parser.add_argument(
        "--tiny-model", metavar="DIR", help="also write a tiny random-init Qwen2-VL directory to DIR"
    )
    args = parser.parse_args(argv)
    if args.tiny_model:
        print(f"wrote a tiny Qwen2-VL to {write_tiny_model(args.tiny_model, args.seed)}")
    path = write_sample(args.out, args.seed)
    n = len(list((Path(args.out) / "screens").glob("*.png")))
    print(f"wrote {path} and {n} screenshots under {Path(args.out) / 'screens'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
