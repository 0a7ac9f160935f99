"""The bundled GUI-agent sample (``examples/gui_agent_sample.py``): regenerated the same, its records
in the documented shape, images where they say, and its text valid for the text reader."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "examples" / "data" / "gui_agent"


def _generator():
    file = ROOT / "examples" / "gui_agent_sample.py"
    spec = importlib.util.spec_from_file_location("gui_agent_sample", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = tmp_path_factory.mktemp("gui")
    path = _generator().write_sample(out, seed=0)
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def _images(messages) -> list[str]:
    return [
        part["image_url"]["url"]
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "image_url"
    ]


def _text_only(messages) -> list[dict]:
    """The conversation with image parts dropped and text parts joined (what the text reader takes)."""
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            m = {**m, "content": "".join(p["text"] for p in m["content"] if p["type"] == "text")}
        out.append(m)
    return out


def test_regenerated_sample_is_the_bundled_one(sample):
    """Deterministic: the same JSONL and the same pixels as the files in examples/data/gui_agent."""
    path, _ = sample
    assert path.read_text() == (BUNDLED / "gui_agent.jsonl").read_text()
    made = sorted(p.name for p in (path.parent / "screens").glob("*.png"))
    assert made == sorted(p.name for p in (BUNDLED / "screens").glob("*.png"))
    for name in made:
        a, b = Image.open(path.parent / "screens" / name), Image.open(BUNDLED / "screens" / name)
        assert a.size == b.size and a.tobytes() == b.tobytes(), name


def test_records_have_tools_tool_calls_and_screenshots(sample):
    path, records = sample
    assert [r["id"] for r in records] == ["login", "search", "refresh", "dialog"]
    used = set()
    for r in records:
        assert [t["function"]["name"] for t in r["tools"]] == ["click", "type_text"]
        assert len(r["messages"]) == len(r["rewards"]) >= 2  # several samples per prompt
        for conv in r["messages"]:
            assert [m["role"] for m in conv[:2]] == ["system", "user"]
            assert conv[-1]["role"] == "assistant" and isinstance(conv[-1]["content"], str)
            for m, nxt in zip(conv, conv[1:]):
                for call in m.get("tool_calls") or []:  # answered by a tool message with a screenshot
                    assert call["function"]["name"] in ("click", "type_text")
                    assert nxt["role"] == "tool" and nxt["tool_call_id"] == call["id"]
                    assert [p["type"] for p in nxt["content"]] == ["text", "image_url"]
            for url in _images(conv):
                used.add(url)
                size = Image.open(path.parent / url).size  # relative to the JSONL file
                assert all(56 <= s <= 112 for s in size), (url, size)
    assert used == {f"screens/{p.name}" for p in (path.parent / "screens").glob("*.png")}  # no stray file


def test_branches_after_a_screenshot_and_identical_text_with_other_pixels(sample):
    path, records = sample
    login = {r["id"]: r for r in records}["login"]["messages"]
    # three samples share the first click's screenshot, then act differently
    shared = [conv[:4] for conv in login[:3]]
    assert shared[0] == shared[1] == shared[2] and shared[0][3]["role"] == "tool"
    assert len({json.dumps(conv[4]) for conv in login[:3]}) == 2  # alice twice, alcie once; later they differ
    refresh = {r["id"]: r for r in records}["refresh"]["messages"]
    a, b = refresh
    assert json.dumps(_text_only(a)) == json.dumps(_text_only(b))  # the same text...
    ia, ib = _images(a), _images(b)
    assert ia[0] == ib[0] and ia[1] != ib[1]  # ...but another screenshot after Refresh
    pixels = [Image.open(path.parent / u).tobytes() for u in (ia[1], ib[1])]
    assert pixels[0] != pixels[1]


def test_text_of_every_record_reads_with_the_text_reader(sample, tmp_path):
    """The records with their image parts dropped validate and render with the Qwen chat template:
    tool calls and results in order, arguments valid, several paths sharing a prefix per record."""
    import treetrain

    _, records = sample
    text = tmp_path / "text.jsonl"
    with open(text, "w") as f:
        for r in records:
            f.write(json.dumps({**r, "messages": [_text_only(c) for c in r["messages"]]}) + "\n")
    treetrain.validate_file(text, tokenizer="qwen")
    trees = {info.id: tree for tree, info in treetrain.iter_trees(text, tokenizer="qwen")}
    assert set(trees) == {"login", "search", "refresh", "dialog"}
    for rid, tree in trees.items():
        assert tree.num_paths == len({r["id"]: r for r in records}[rid]["messages"])
        assert tree.num_tokens < tree.num_path_tokens  # the shared prefix is stored once


def _image_tree(record, root: Path):
    """The record as a tree with images, tokenized crudely (one id per character of each message's
    text, each screenshot as Qwen2-VL placeholders from the PIL image processor, 8-pixel patches):
    what the data reader does with a real chat template, enough to see what merges."""
    import transformers

    import treetrain

    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=128 * 128
    )
    paths, images = [], []
    for conv in record["messages"]:
        ids, ims = [], []
        for m in conv:
            parts = (
                m["content"]
                if isinstance(m["content"], list)
                else [{"type": "text", "text": m["content"] or ""}]
            )
            text = m["role"] + json.dumps(m.get("tool_calls"))
            ids += [3 + ord(c) % 90 for c in text]
            for p in parts:
                if p["type"] == "text":
                    ids += [3 + ord(c) % 90 for c in p["text"]]
                else:
                    fields = processor(images=[Image.open(root / p["image_url"]["url"])], return_tensors="pt")
                    n = int(fields["image_grid_thw"].prod()) // 4
                    ims.append(treetrain.ImageInput(dict(fields), num_tokens=n, token_id=100))
                    ids += [101] + [100] * n + [102]
        paths.append(ids)
        images.append(ims)
    return treetrain.TrajectoryTree.from_paths(paths, images=images), paths


def test_images_merge_only_where_the_pixels_agree(sample):
    """As a tree with its images: the refresh record's two paths (the same ids) part at the second
    screenshot; each record has one image per distinct screenshot file it uses."""
    path, records = sample
    by_id = {r["id"]: r for r in records}
    tree, paths = _image_tree(by_id["refresh"], path.parent)
    assert paths[0] == paths[1]  # identical token ids, placeholders included
    first_image_end = paths[0].index(102) + 1
    part = paths[0].index(100, first_image_end)  # the second screenshot's first placeholder
    assert tree.num_tokens == part + 2 * (len(paths[0]) - part)  # the two part there
    for r in records:
        tree, _ = _image_tree(r, path.parent)
        assert len(tree.image_table.images) == len({u for conv in r["messages"] for u in _images(conv)}), r[
            "id"
        ]
