"""``treetrain train --model VLM_DIR``: ``final/`` holds the whole trained vision-language model and
its processor (image processor, tokenizer, chat template), reloads with the Hugging Face auto classes
and replies to an image message."""

from __future__ import annotations

import pytest
import torch
import transformers


def _train_one_step(tmp_path, model_type: str):
    """``treetrain train`` for one step (token-id text trees, float32, a checkpoint at the step) on a
    tiny ``model_type`` policy saved with its processor; returns ``(model_dir, run_dir, processor)``."""
    import json

    from treetrain.cli import main

    from .trl_vlm import save_vlm_policy

    model_dir = tmp_path / "policy"
    _, processor = save_vlm_policy(model_type, model_dir)
    processor.save_pretrained(model_dir)
    if model_type == "qwen2_vl":  # as a hub Qwen2-VL directory has it (the test's class is image-only)
        for name in ("processor_config.json", "tokenizer_config.json"):
            cfg = json.loads((model_dir / name).read_text())
            cfg["processor_class"] = "Qwen2VLProcessor"
            (model_dir / name).write_text(json.dumps(cfg))
        video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 4, "merge_size": 2}
        (model_dir / "video_preprocessor_config.json").write_text(json.dumps(video))
    data = tmp_path / "paths.jsonl"
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 49, (6,), generator=g).tolist()
    rows = [prompt + torch.randint(3, 49, (4,), generator=g).tolist() for _ in range(3)]
    data.write_text(json.dumps({"paths": rows}) + "\n")
    out = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--data", str(data), "--steps", "1", "--lr", "1e-2"]
    assert main([*argv, "--checkpoint-every", "1", "--output", str(out), "--no-progress"]) == 0
    return model_dir, out, processor


def _assert_final_is_the_trained_model(model_dir, out):
    """``final/``'s every weight, vision tower included, equals the run's last checkpoint (the trained
    model); the language model moved from the initial weights (text data: the tower got no gradient)."""
    from treetrain.train.checkpoint import load_checkpoint

    final = transformers.AutoModelForImageTextToText.from_pretrained(out / "final").eval()
    trained = transformers.AutoModelForImageTextToText.from_pretrained(model_dir)
    initial = dict(trained.named_parameters())
    initial = {n: p.detach().clone() for n, p in initial.items()}
    load_checkpoint(out, trained, None, None)
    got, want = final.state_dict(), trained.state_dict()
    assert got.keys() == want.keys()
    vision = [n for n in got if ".visual." in n or "vision_tower" in n]
    assert vision, "no vision tower weights in final/"
    for n in got:
        assert torch.equal(got[n], want[n]), n
    moved = [n for n, p in initial.items() if not torch.equal(p, got[n])]
    assert moved and not any(n in vision for n in moved)
    return final


_IMAGE_MESSAGE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}]


def _generate(model, processor, size) -> torch.Tensor:
    from .trl_vlm import pil_image

    text = processor.apply_chat_template(_IMAGE_MESSAGE, add_generation_prompt=True)
    inputs = processor(text=[text], images=[pil_image(3, size)], return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, n + 4)
    assert isinstance(processor.decode(out[0, n:]), str)
    return out[0, n:]


@pytest.mark.parametrize("model_type", ["gemma3", "llava"])
def test_cli_final_reloads_with_auto_classes_and_replies_to_an_image(tmp_path, model_type):
    """``treetrain train --model DIR`` (a VLM directory saved with its processor): ``final/`` holds the
    whole trained model and the processor (image processor, tokenizer, chat template), loads with
    ``AutoModelForImageTextToText`` and ``AutoProcessor``, and ``generate`` replies to an image message
    (the same tokens as the trained weights loaded from the checkpoint, with the source's processor)."""
    model_dir, out, processor = _train_one_step(tmp_path, model_type)
    for name in ("processor_config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        assert (out / "final" / name).is_file(), name
    final = _assert_final_is_the_trained_model(model_dir, out)
    loaded = transformers.AutoProcessor.from_pretrained(out / "final")
    assert type(loaded) is type(processor)
    assert type(loaded.image_processor) is type(processor.image_processor)
    assert loaded.chat_template == processor.chat_template
    size = (40, 24)
    reply = _generate(final, loaded, size)
    assert torch.equal(reply, _generate(final, processor, size))


def test_cli_final_of_qwen2_vl_holds_its_processor_files(tmp_path):
    """Qwen2-VL: ``final/`` holds the processor's files as the source directory had them
    (``processor_class`` Qwen2VLProcessor, a video processor config). ``AutoProcessor`` builds that
    class, whose video processor needs torchvision: without it (this test's environment) AutoProcessor
    raises transformers' ImportError naming torchvision, so the processor is rebuilt from final/'s
    files with the PIL image processor class, and the model replies to an image."""
    import importlib.util

    from .trl_vlm import _ImageOnlyQwen2VLProcessor

    model_dir, out, _ = _train_one_step(tmp_path, "qwen2_vl")
    final_dir = out / "final"
    for name in ("processor_config.json", "video_preprocessor_config.json", "chat_template.jinja"):
        assert (final_dir / name).read_bytes() == (model_dir / name).read_bytes(), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (final_dir / name).is_file(), name
    final = _assert_final_is_the_trained_model(model_dir, out)
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ImportError, match="Torchvision"):
            transformers.AutoProcessor.from_pretrained(final_dir)
    image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(final_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(final_dir)
    template = (final_dir / "chat_template.jinja").read_text()
    processor = _ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=template)
    assert image_processor.patch_size == final.config.vision_config.patch_size
    _generate(final, processor, (32, 24))


def test_export_processor_files_copies_only_what_final_lacks(tmp_path):
    """The processor's files are copied; files already in final/ (the tokenizer's, written from
    ``--tokenizer``) stay; weights, config and unrelated files are not copied; no source: nothing."""
    from treetrain.train.checkpoint import export_processor_files

    src, out = tmp_path / "model", tmp_path / "final"
    src.mkdir()
    out.mkdir()
    for name in ("processor_config.json", "preprocessor_config.json", "chat_template.jinja", "notes.txt"):
        (src / name).write_text(f"source {name}")
    (src / "model.safetensors").write_text("weights")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool.jinja").write_text("tool template")
    (out / "chat_template.jinja").write_text("the tokenizer's template")
    copied = export_processor_files(src, out)
    assert copied == ["processor_config.json", "preprocessor_config.json", "additional_chat_templates"]
    assert (out / "chat_template.jinja").read_text() == "the tokenizer's template"
    assert (out / "additional_chat_templates" / "tool.jinja").read_text() == "tool template"
    assert not (out / "notes.txt").exists() and not (out / "model.safetensors").exists()
    assert export_processor_files(None, out) == [] and export_processor_files(tmp_path / "none", out) == []
