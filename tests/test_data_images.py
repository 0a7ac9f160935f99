"""Chat records with images (treetrain.data.images) through the CLI: OpenAI ``image_url`` parts (file
relative to the data file, data URL), HF ``image`` parts, TRL's ``images`` column; tree == per-path
baseline (float64), the first loss equal to each conversation's own HF forward with its images, and
each bad-image case a one-line error (exit 2)."""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest
import torch
import transformers

from treetrain.cli import main

from .reference import float64_casts
from .trl_vlm import pil_image, save_vlm_policy


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(img)).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny Qwen2-VL (float64) with its offline processor, and three screenshots as PNG files."""
    d = tmp_path_factory.mktemp("vdata")
    model_dir = d / "model"
    _, proc = save_vlm_policy("qwen2_vl", model_dir, dtype=torch.float64)
    proc.save_pretrained(model_dir)
    (d / "shots").mkdir()
    for i in range(3):
        pil_image(i, (16, 16 + 8 * (i % 2))).save(d / "shots" / f"s{i}.png")
    return d, proc


def _openai(i: int, shot: str, reply: str) -> dict:
    """A user message with a screenshot, a tool call, a tool result with a screenshot, two replies."""
    return {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "open the menu."},
                                     {"type": "image_url", "image_url": {"url": "shots/s0.png"}}]},
        {"role": "assistant", "content": "click 3 4"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": shot}},
                                     {"type": "text", "text": "now?"}]},
        {"role": "assistant", "content": reply},
    ], "id": f"r{i}"}  # fmt: skip


def openai_records(d) -> list[dict]:
    """Rows sharing the first screenshot; the second the same file, a data URL of the same pixels
    (merges with it), or different pixels (parts)."""
    same = _data_url(pil_image(1, (16, 24)))
    convs = [
        _openai(0, "shots/s1.png", "done."),
        _openai(1, same, "type ok"),
        _openai(2, str(d / "shots" / "s2.png"), "wait"),
    ]
    return [{"messages": [c["messages"] for c in convs]}, _openai(3, "shots/s1.png", "ok")]


def hf_records(d) -> list[dict]:
    return [{"messages": [[
        {"role": "user", "content": [{"type": "image", "path": "shots/s0.png"},
                                     {"type": "text", "text": "what is this?"}]},
        {"role": "assistant", "content": a},
    ] for a in ("a cat.", "a dog")]}]  # fmt: skip


def trl_records(d) -> list[dict]:
    """One row per conversation; rows 0 and 1 the same pixels."""
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color?"}]}
    return [
        {"messages": [user, {"role": "assistant", "content": a}], "images": [_data_url(pil_image(k))]}
        for k, a in ((0, "red"), (0, "blue."), (2, "green"))
    ]


LAYOUTS = {"openai": openai_records, "hf": hf_records, "trl": trl_records}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _train(model_dir, data, out, *extra) -> list[dict]:
    args = ["train", "--model", str(model_dir), "--data", str(data), "--output", str(out),
            "--steps", "2", "--lr", "1e-2", "--warmup-steps", "1", "--dtype", "float64",
            "--no-progress", *extra]  # fmt: skip
    with float64_casts():
        assert main(args) == 0
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(path) -> dict[str, torch.Tensor]:
    m = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _reference_loss(model_dir, proc, records, d) -> float:
    """SFT's first loss from each conversation's own HF forward: processor on its text + images, mean
    log-prob over assistant tokens (all conversations' tokens together, as the data is one batch)."""
    from PIL import Image

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float64)
    total, count = 0.0, 0
    convs = [
        (c, rec.get("images", []))
        for rec in records
        for c in (rec["messages"] if isinstance(rec["messages"][0], list) else [rec["messages"]])
    ]
    for conv, urls in convs:
        msgs, images = [], []
        column = [Image.open(io.BytesIO(base64.b64decode(u.split(",")[1]))) for u in urls]
        for m in conv:
            if isinstance(m["content"], list):
                parts = []
                for c in m["content"]:
                    if c["type"] in ("image", "image_url"):
                        src = c.get("path") or (c.get("image_url") or {}).get("url")
                        if src is None:
                            img = column.pop(0)
                        elif src.startswith("data:"):
                            img = Image.open(io.BytesIO(base64.b64decode(src.split(",")[1])))
                        else:
                            img = Image.open(d / src)
                        images.append(img.convert("RGB"))
                        parts.append({"type": "image"})
                    else:
                        parts.append(c)
                m = {**m, "content": parts}
            msgs.append(m)
        # the assistant turns: their content's tokens after each "assistant: " (the test template
        # renders no newlines: jinja's trim_blocks)
        text = proc.apply_chat_template(msgs, tokenize=False)
        inputs = proc(text=[text], images=images or None, return_tensors="pt")
        ids = inputs["input_ids"][0]
        mask = torch.zeros_like(ids, dtype=torch.bool)
        head = proc.tokenizer("assistant: ", add_special_tokens=False)["input_ids"]
        replies = iter(
            [
                c if isinstance(c, str) else "".join(p["text"] for p in c)
                for c in (m["content"] for m in msgs if m["role"] == "assistant")
            ]
        )
        for i in range(len(ids) - len(head) + 1):
            if ids[i : i + len(head)].tolist() == head:
                n = len(proc.tokenizer(next(replies), add_special_tokens=False)["input_ids"])
                mask[i + len(head) : i + len(head) + n] = True
        with torch.no_grad():
            logits = model(**inputs).logits[0].double()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        total += float(-lp[mask[1:]].sum())
        count += int(mask.sum())
    return total / count


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_image_layout_trains_tree_equals_sequence(vlm, tmp_path, layout):
    d, proc = vlm
    records = LAYOUTS[layout](d)
    data = _write(d / f"{layout}.jsonl", records)
    tree = _train(d / "model", data, tmp_path / "tree", "--batch-trees", str(len(records)))
    seq = _train(
        d / "model", data, tmp_path / "seq", "--batch-trees", str(len(records)), "--packing", "sequence"
    )
    lt, ls = np.array([r["loss"] for r in tree]), np.array([r["loss"] for r in seq])
    dl = float(np.max(np.abs(lt - ls) / np.abs(ls)))
    wt, ws, w0 = (
        _weights(tmp_path / "tree" / "final"),
        _weights(tmp_path / "seq" / "final"),
        _weights(d / "model"),
    )
    dw = max(float((wt[k] - ws[k]).abs().max() / ws[k].abs().max().clamp_min(1e-30)) for k in ws)
    moved = max(float((ws[k] - w0[k]).abs().max()) for k in ws)
    ref = _reference_loss(d / "model", proc, records, d)
    d0 = abs(lt[0] - ref) / ref
    tokens = f"{tree[0]['tree_tokens']}/{tree[0]['tokens']}"
    print(
        f"{layout}: loss rel {dl:.3g}, weight rel {dw:.3g}, first loss vs HF {d0:.3g}, tree tokens {tokens}"
    )
    assert dl < 1e-6 and dw < 1e-6 and moved > 0 and d0 < 1e-6


# ---- errors: exit 2, naming file, line, message and part, and the fix ----------------------------


def _one(content: list, role: str = "user") -> dict:
    return {"messages": [{"role": role, "content": content}, {"role": "assistant", "content": "ok"}]}


def _url(u: str) -> list:
    return [{"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": "hi"}]


@pytest.fixture(scope="module")
def bad_models(vlm):
    """A copy of the model whose template drops images of tool messages; a text-only model with the
    same tokenizer."""
    import shutil

    from .reference import tiny_config

    d, _ = vlm
    drops = d / "drops"
    shutil.copytree(d / "model", drops)
    t = (drops / "chat_template.jinja").read_text()
    (drops / "chat_template.jinja").write_text(
        t.replace("{% if c.type == 'image' %}", "{% if c.type == 'image' and m.role != 'tool' %}")
    )
    text = d / "text"
    tiny_config("qwen3", vocab=128).save_pretrained(text)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(d / "model" / f, text / f)
    (d / "bad.png").write_bytes(b"not a png at all")
    pil_image(7, (64, 64)).save(d / "big.png")
    return drops, text


P0 = r"\[0\]\[\"content\"\]\[0\]"  # message 0, its content part 0
ERRORS = {
    "missing": (_one(_url("shots/nope.png")), "model", P0 + r": image: image file .*nope.png not found"),
    "unreadable": (_one(_url("bad.png")), "model", P0 + r": image: unreadable image .*give a PNG/JPEG"),
    "bad_data_url": (_one(_url("data:image/png;base64,@@@")), "model", r"bad data URL: its base64 payload"),
    "not_base64": (
        _one(_url("data:image/png,xyz")),
        "model",
        r"bad data URL \(expected data:image/<type>;base64",
    ),
    "web_url": (_one(_url("https://x.org/a.png")), "model", r"web URL; treetrain never downloads"),
    "too_large": (
        _one(_url("big.png")),
        "model",
        r"64x64 = 4096 pixels exceeds the processor's max_pixels 1024.*downscale",
    ),
    "extra_image": (
        {**_one([{"type": "image"}]), "images": [_data_url(pil_image(0)), _data_url(pil_image(1))]},
        "model",
        r"1 image\(s\) of the record's images have no",
    ),
    "no_image_left": (_one([{"type": "image"}]), "model", P0 + r": an image placeholder with no image left"),
    "typed_placeholder": (
        _one([{"type": "text", "text": "<|image_pad|>"}, *_url("shots/s0.png")]),
        "model",
        r"control token '<\|image_pad\|>'",
    ),
    "template_drops": (
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": "look",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": _url("shots/s0.png")},
                {"role": "assistant", "content": "ok"},
            ]
        },
        "drops",
        r"\[2\]" + P0[5:] + r": the chat template rendered 0 image markers for 1 image parts",
    ),
    "video_part": (
        _one([{"type": "video", "path": "clip.mp4"}, {"type": "text", "text": "hi"}]),
        "model",
        P0 + r": only .*text.* and image .*content parts are supported",  # a video is not read from records
    ),
    "text_only_model": (
        _one(_url("shots/s0.png")),
        "text",
        P0 + r": an image part, but the model is text-only",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_image_errors_exit_2(vlm, bad_models, tmp_path, case, capsys):

    d, _ = vlm
    record, model, pattern = ERRORS[case]
    model_dir = {"model": d / "model", "drops": bad_models[0], "text": bad_models[1]}[model]
    data = _write(d / f"err_{case}.jsonl", [record])
    rc = main(["train", "--model", str(model_dir), "--data", str(data), "--output", str(tmp_path / "o"),
               "--steps", "1", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err  # one line: file:line, record, message, part, the fix
    assert lines[0].startswith("treetrain train: error: ") and f"err_{case}.jsonl:1:" in lines[0], err
    assert re.search(pattern, lines[0]), err


# ---- policy gradient, DPO, stats -----------------------------------------------------------------


def _pairs(d) -> list[dict]:
    """Preference pairs whose prompt carries a screenshot (TRL's images column, and a file part)."""
    return [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "click?"}]}],
            "chosen": [{"role": "assistant", "content": "click 1 2"}],
            "rejected": [{"role": "assistant", "content": "no."}],
            "images": [_data_url(pil_image(0))],
        },
        {
            "prompt": [{"role": "user", "content": _url("shots/s1.png")}],
            "chosen": [{"role": "assistant", "content": "type ok"}],
            "rejected": [{"role": "assistant", "content": "wait"}],
        },
    ]


@pytest.mark.parametrize(
    "objective",
    ["grpo", "dpo"],
)
def test_image_objectives_tree_equals_sequence(vlm, tmp_path, objective):
    """GRPO (advantages in the data) and DPO (preference pairs with images): tree == per-path. DPO's
    step merges its pair trees into one (objectives.preference.pairs.merge_pairs): their images go too."""
    d, _ = vlm
    if objective == "grpo":
        records = openai_records(d)
        records[0]["advantages"] = [1.0, -0.5, 0.25]
        records[1]["advantages"] = [0.5]
    else:
        records = _pairs(d)
    data = _write(d / f"{objective}.jsonl", records)
    extra = ("--objective", objective, "--batch-trees", str(len(records)))
    tree = _train(d / "model", data, tmp_path / "tree", *extra)
    seq = _train(d / "model", data, tmp_path / "seq", *extra, "--packing", "sequence")
    lt, ls = np.array([r["loss"] for r in tree]), np.array([r["loss"] for r in seq])
    dl = float(np.max(np.abs(lt - ls) / np.maximum(np.abs(ls), 1e-12)))
    wt, ws, w0 = (_weights(p) for p in (tmp_path / "tree" / "final", tmp_path / "seq" / "final", d / "model"))
    dw = max(float((wt[k] - ws[k]).abs().max() / ws[k].abs().max().clamp_min(1e-30)) for k in ws)
    moved = max(float((ws[k] - w0[k]).abs().max()) for k in ws)
    print(f"{objective}: losses {lt.tolist()}, loss rel {dl:.3g}, weight rel {dw:.3g}")
    assert dl < 1e-6 and dw < 1e-6 and moved > 0


def test_stats_reports_images(vlm, capsys):
    """``treetrain stats``: images per path, distinct images (a data URL of s1's pixels is s1), vision
    patches and FLOPs saved."""
    d, _ = vlm
    data = _write(d / "stats.jsonl", openai_records(d))
    assert main(["stats", "--model", str(d / "model"), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    # tree 1: s0 x3, s1 x2 (file, data URL), s2 -> 3 distinct; tree 2: s0, s1 -> 2
    assert re.search(r"images \(sum over paths\)\s+8\n", out), out
    assert re.search(r"distinct images \(encoded by the tree\)\s+5\n", out), out
    assert re.search(r"vision patches \(baseline / tree\)\s+\d+ / \d+", out), out
    assert re.search(r"vision FLOPs saved\s+\d+\.\d% \(the tower", out), out


def test_parquet_image_feature(vlm, tmp_path):
    """A ``datasets`` table (Parquet) whose ``images`` column holds Image features (PNG bytes): trains,
    tree == per-path, and the first loss equals the conversations' own HF forwards."""
    from datasets import Dataset

    d, proc = vlm
    records = trl_records(d)
    # one type per column for Arrow: the assistant's content as a list of text parts too
    for r in records:
        a = r["messages"][1]
        a["content"] = [{"type": "text", "text": a["content"]}]
    table = Dataset.from_dict({
        "messages": [r["messages"] for r in records],
        "images": [[pil_image(k)] for k in (0, 0, 2)],
    })  # fmt: skip
    data = tmp_path / "rows.parquet"
    table.to_parquet(str(data))
    tree = _train(d / "model", data, tmp_path / "tree", "--batch-trees", "3")
    seq = _train(d / "model", data, tmp_path / "seq", "--batch-trees", "3", "--packing", "sequence")
    lt, ls = np.array([r["loss"] for r in tree]), np.array([r["loss"] for r in seq])
    ref = _reference_loss(d / "model", proc, records, d)
    print(f"parquet: losses {lt.tolist()} vs {ls.tolist()}, first vs HF {abs(lt[0] - ref) / ref:.3g}")
    assert np.max(np.abs(lt - ls) / np.abs(ls)) < 1e-6 and abs(lt[0] - ref) / ref < 1e-6


def test_trl_prompt_completion_rows_merge_only_where_images_agree(vlm, tmp_path):
    """TRL's conversational prompt/completion rows with an ``images`` column: rows of one prompt are
    grouped by its text, so the tree must still part where the pixels differ. Rows 0 and 1: the same
    screenshot (they share it); row 2: the same text, other pixels (its own image node)."""
    from treetrain.data.reader import iter_trees

    d, _ = vlm
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color?"}]}]
    rows = [
        {
            "prompt": prompt,
            "completion": [{"role": "assistant", "content": a}],
            "images": [_data_url(pil_image(k))],
        }
        for k, a in ((0, "red"), (0, "blue."), (2, "green"))
    ]
    trees = [t for t, _ in iter_trees(_write(tmp_path / "rows.jsonl", rows), tokenizer=str(d / "model"))]
    assert len(trees) == 1 and trees[0].num_paths == 3  # one prompt: one tree
    (tree,) = trees
    assert len(tree.image_table.images) == 2  # two distinct screenshots, encoded once each
    keys = [tree.fields["images"][p][0].key for p in range(3)]
    assert keys[0] == keys[1] != keys[2]
