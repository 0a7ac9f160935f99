"""A custom GRPO loop whose scoring runs as prefix trees, through ``treetrain.integrations.flat``.

The loop keeps the usual padded layout of RL trainers: left-padded prompts, right-padded sampled
completions, one ``[B, P + C]`` batch. ``flat_logprobs`` turns it into a tree (each prompt once, its
G completions as branches), runs one forward and hands back ``[B, C]`` log-probs, differentiable.

Toy task on a tiny random-init Qwen3 (CPU, about a minute): the reward is the share of the
token ``TARGET`` in a completion; the mean reward rises as the policy learns to emit it.

    python examples/custom_grpo_loop.py          # 20 steps; reward ~0.02 -> ~0.85
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from treetrain.integrations.flat import flat_logprobs

PAD, EOS, TARGET, VOCAB = 0, 1, 7, 32


def tiny_policy(seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def sample(model, prompts: torch.Tensor, group: int, max_new: int):
    """``prompts [N, P]`` -> ids ``[N * G, P + C]``, attention mask, completion mask ``[N * G, C]``."""
    ids = prompts.repeat_interleave(group, 0)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=max_new,
            eos_token_id=EOS, pad_token_id=PAD,
        )  # fmt: skip
    comp = out[:, ids.shape[1] :]
    after_eos = (comp == EOS).int().cumsum(1) - (comp == EOS).int()  # > 0 strictly after the first eos
    comp_mask = (after_eos == 0).long()
    return out, torch.cat([torch.ones_like(ids), comp_mask], 1), comp_mask


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = tiny_policy(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    t0, first = time.perf_counter(), None
    for step in range(args.steps):
        prompts = torch.randint(2, VOCAB, (args.prompts, args.prompt_len), generator=g)
        ids, attn, comp_mask = sample(model.eval(), prompts, args.group, args.max_new)
        C = comp_mask.shape[1]
        rewards = ((ids[:, -C:] == TARGET) * comp_mask).sum(1) / comp_mask.sum(1).clamp(min=1)
        adv = group_advantages(rewards.float(), args.group)

        model.train()
        logp = flat_logprobs(model, ids, attn, logits_to_keep=C)  # [B, C]: one tree forward
        ratio = torch.exp(logp - logp.detach())  # on-policy: 1, with the policy gradient
        loss = -((ratio * adv[:, None]) * comp_mask).sum() / comp_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

        mean = rewards.float().mean().item()
        first = mean if first is None else first
        print(f"step {step:3d}  reward {mean:.3f}  loss {loss.item():+.4f}  {time.perf_counter() - t0:5.1f}s")
    return mean - first


if __name__ == "__main__":
    main()
