"""The ground truth every tree computation is checked against: each path alone, through the
unmodified Hugging Face model (its own attention implementation, its own full-vocab log-softmax).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import transformers

ARCHS = ("qwen3", "llama")


def tiny_config(arch: str, vocab: int = 97, **over):
    """A few-layer random-init config of a real architecture (no download)."""
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    common.update(over)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    raise ValueError(arch)


def tiny_model(arch: str, dtype=torch.float64, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = tiny_config(arch, **over)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # widen the init so log-probs are far from uniform and errors show
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
    return model


def reference_copy(model):
    """A deep copy that stays unmodified (its own attention, no tree patches)."""
    return copy.deepcopy(model)


def fresh_rotary(model) -> None:
    """Put every rotary module back in the state a freshly built model has (HF's own reset).

    HF's dynamic-NTK rotary is stateful: a forward longer than ``max_position_embeddings`` grows its
    table to that length, and a later forward keeps it unless it is shorter than
    ``max_position_embeddings`` (then it resets). So one model scoring path after path gives a path
    a table that depends on the paths before it. "A path's own forward" is a fresh model's.
    """
    for m in model.modules():
        if not (hasattr(m, "original_max_seq_len") and hasattr(m, "max_seq_len_cached")):
            continue
        for name in [n for n in m._buffers if n.endswith("original_inv_freq")]:
            m._buffers[name[: -len("original_inv_freq")] + "inv_freq"] = m._buffers[name].clone()
        for name in [n for n in vars(m) if n.endswith("max_seq_len_cached")]:
            setattr(m, name, m.original_max_seq_len)


def reference_logprobs(model, paths, return_entropy: bool = False):
    """``[len(p) - 1]`` log-probs per path, each path its own forward from position 0 (from a fresh
    rotary state: :func:`fresh_rotary`)."""
    out, ents = [], []
    device = model.get_input_embeddings().weight.device
    for p in paths:
        fresh_rotary(model)
        ids = torch.as_tensor(list(p), dtype=torch.long, device=device)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        lsm = torch.log_softmax(logits, dim=-1)
        out.append(lsm.gather(1, ids[0, 1:, None])[:, 0])
        ents.append(-(lsm.exp() * lsm).sum(-1))
    return (out, ents) if return_entropy else out


@contextlib.contextmanager
def float64_casts():
    """Keep float64 models in float64: HF norms and rotary embeddings cast to float32 internally.

    Inside, ``Tensor.float()`` and ``Tensor.to(torch.float32)`` give float64. Both the reference
    and the tree run inside it, so a float64 comparison measures the algorithm, not the casts.
    """
    orig_float, orig_to, orig_type = torch.Tensor.float, torch.Tensor.to, torch.Tensor.type

    def f64_float(self, *a, **k):
        return orig_to(self, torch.float64)

    def f64_to(self, *args, **kwargs):
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return orig_to(self, *args, **kwargs)

    def f64_type(self, dtype=None, *args, **kwargs):  # MoE routers: hidden.type(torch.float32)
        if dtype is torch.float32 or dtype in ("torch.FloatTensor", "torch.float32"):
            dtype = torch.float64
        return orig_type(self, dtype, *args, **kwargs) if dtype is not None else orig_type(self)

    torch.Tensor.float, torch.Tensor.to, torch.Tensor.type = f64_float, f64_to, f64_type
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to, torch.Tensor.type = orig_float, orig_to, orig_type


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (max-norm relative error; 0 when both are 0)."""
    den = b.abs().max().item()
    num = (a.double() - b.double()).abs().max().item()
    return num / den if den > 0 else num


def grad_err(tree: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Worst per-parameter relative error of the gradients.

    Each parameter's error is relative to its own largest entry, floored at 1e-3 of the largest
    gradient entry in the model: a parameter whose true gradient is 0 (e.g. q/k when every token
    is the same) has a reference gradient of pure rounding noise, which no relative measure fits.
    """
    assert tree.keys() == ref.keys(), sorted(set(tree) ^ set(ref))
    scale = max(g.abs().max().item() for g in ref.values())
    if scale == 0.0:  # e.g. only one-token paths: nothing to predict, all gradients are 0
        return max((t.abs().max().item() for t in tree.values()), default=0.0)
    worst = 0.0
    for n, b in ref.items():
        den = max(b.abs().max().item(), 1e-3 * scale)
        worst = max(worst, (tree[n].double() - b.double()).abs().max().item() / den)
    return worst


def saved_weights(path, auto) -> dict[str, torch.Tensor]:
    """Every parameter of the model saved under ``path`` (loaded with ``auto``), in float64."""
    return {k: v.double() for k, v in auto.from_pretrained(path).state_dict().items()}


def update_err(tree: dict, seq: dict, init: dict) -> float:
    """``|w_tree - w_seq| / |w_seq - w_0|`` over all parameters (2-norm): two runs' weights apart,
    relative to the update one of them made."""
    num = sum(((tree[k] - seq[k]) ** 2).sum().item() for k in seq)
    den = sum(((seq[k] - init[k]) ** 2).sum().item() for k in seq)
    return math.sqrt(num / den)


def random_coeffs(paths, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(p) - 1, generator=g, dtype=dtype) for p in paths]
