"""Load-independent measurements (treetrain.bench.measure): FLOPs counted op by op and the peak of
live tensors, on hand-written steps whose numbers are spelled out; and the FLOP model's pricing of
what a step recomputes (head logits, activation checkpointing), checked against the count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treetrain.bench.measure import count_flops, peak_bytes
from treetrain.trees.flops import CostModel, Work

from .reference import tiny_model


def test_matmuls_split_into_head_and_linear():
    h, w_dec, w_head = torch.randn(4, 8), torch.randn(8, 8), torch.randn(16, 8)
    acc = torch.zeros(16, 8)

    def step():
        x = h @ w_dec  # 2 * 4 * 8 * 8 = 512, decoder
        x @ w_head.t()  # 2 * 4 * 8 * 16 = 1024, head (a vocab-16 dimension)
        acc.addmm_(w_head, w_dec)  # in place, as TRL's head accumulates its gradient: 2 * 16 * 8 * 8

    c = count_flops(step, vocab=16)
    assert (c["linear"], c["head"], c["attention"]) == (512, 1024 + 2048, 0)
    assert c["total"] == 3584 and c["logit_elements"] == 0


def test_cpu_flash_attention_counts_computed_pairs():
    q = torch.randn(1, 2, 16, 8, requires_grad=True)  # [B, H, L, D]
    mask = torch.ones(16, 16, dtype=torch.bool).tril()

    def sdpa(**kw):
        return lambda: F.scaled_dot_product_attention(q, q, q, **kw).sum().backward()

    # causal: 16 * 17 / 2 = 136 pairs; forward 4 FLOPs per pair, head and dim; backward twice that
    assert count_flops(sdpa(is_causal=True))["attention"] == 3 * 4 * 2 * 136 * 8
    # an explicit mask: the kernel scores all 16 x 16 pairs, whatever the mask allows
    assert count_flops(sdpa(attn_mask=mask))["attention"] == 3 * 4 * 2 * 256 * 8


def test_logit_elements_count_elementwise_passes_over_the_vocab():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8)
    # log_softmax forward (4 x 16), and backward: the gather's zero-filled gradient and log_softmax's
    c = count_flops(lambda: (h @ w.t()).log_softmax(-1)[:, 0].sum().backward(), vocab=16)
    assert c["logit_elements"] == 3 * 4 * 16


def test_peak_bytes_of_live_tensors():
    def step():
        a = torch.ones(1000, 250)  # 1 MB
        b = torch.ones(500, 250)  # 0.5 MB, alive with a
        del a, b
        torch.ones(250, 250)  # 0.25 MB after both are freed

    assert peak_bytes(step) == 1_500_000


def test_checkpointing_recomputes_all_but_the_down_projection():
    """A tiny Qwen3 trained under torch's non-reentrant checkpoint: its decoder matmuls count
    ``3 * linear + checkpointed`` per token (the recompute stops before each MLP's down projection)."""
    torch.manual_seed(0)
    model = tiny_model("qwen3", dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    cost = CostModel.from_config(model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    c = count_flops(lambda: model(input_ids=ids, labels=ids).loss.backward(), vocab=model.config.vocab_size)
    assert c["linear"] == 12 * (3 * cost.linear + cost.checkpointed)
    assert c["head"] == 3 * 12 * cost.head
    assert c["attention"] == 4 * 78 * cost.per_pair  # causal: 12 * 13 / 2 pairs, recomputed too
    work = Work(tokens=12, pairs=78, targets=12)
    assert work.flops(cost, checkpointing=True) == c["linear"] + c["attention"] + c["head"]
