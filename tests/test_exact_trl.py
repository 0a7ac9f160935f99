"""TreeGRPOTrainer scores with the model's exact head: Cohere's ``logit_scale`` and Gemma 2's
``final_logit_softcapping`` (and attention softcap) give TRL's own log-probs and entropies (before
the fix they differed by 7.2 and 0.20 nats: TRL applies both through the model's forward). TRL loads
the policy with eager attention: SDPA has no attention softcap (HF drops it there), eager is the
model's definition.

Tolerance: both trainers run float32; the truth is TRL's own scoring of the same batch with the
float64 model, each row alone (HF's forward, ``log_softmax(logits / T)``). The tree must stay within
a small multiple (4x) of TRL's own float32 error.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from treetrain.integrations.trl import TreeGRPOTrainer  # noqa: E402

from .reference import float64_casts  # noqa: E402
from .trl_tiny import dataset, reward_len_and_a, save_with_char_tokenizer  # noqa: E402
from .zoo import zoo_model  # noqa: E402


def _policy(model_type: str, path, zero: str | None = None) -> str:
    """A zoo model saved with a character tokenizer; parameters whose name ends with ``zero`` zeroed."""
    model = zoo_model(model_type, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if zero is not None and name.endswith(zero):
                p.zero_()
    return save_with_char_tokenizer(model, path)


def _config(out) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_steps=1,
        max_completion_length=4, temperature=0.9, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "eager"},
    )  # fmt: skip


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[2, 8:] = 0  # a short completion
    return ids, mask


def _truth(model, ids, mask, keep: int, temperature: float):
    """Each row alone (padding stripped) through the float64 model: ``log_softmax(logits / T)`` at the
    last ``keep`` columns, TRL's layout (0 at padding and at a row's first token)."""
    logp, ent = (
        torch.zeros(ids.shape[0], keep, dtype=torch.float64),
        torch.zeros(ids.shape[0], keep, dtype=torch.float64),
    )
    L = ids.shape[1]
    with float64_casts(), torch.no_grad():
        for r in range(ids.shape[0]):
            real = torch.nonzero(mask[r])[:, 0]
            seq = ids[r, real]
            lsm = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1] / temperature, -1)
            for k in range(keep):
                i = L - keep + k - int(real[0])  # index in the stripped row
                if mask[r, L - keep + k] and i > 0:
                    logp[r, k] = lsm[i - 1, seq[i]]
                    ent[r, k] = -(lsm[i - 1].exp() * lsm[i - 1]).sum()
    return logp, ent


@pytest.mark.parametrize("model_type", ["cohere", "gemma2"])
def test_tree_grpo_scores_equal_trl_with_head_transforms(model_type, tmp_path):
    transformers.logging.set_verbosity_error()
    policy = _policy(model_type, tmp_path / "policy")
    kw = dict(model=policy, reward_funcs=reward_len_and_a, args=_config(tmp_path), train_dataset=dataset())
    trl_tr, tree_tr = GRPOTrainer(**kw), TreeGRPOTrainer(**kw)
    ids, mask = _batch()
    m64 = transformers.AutoModelForCausalLM.from_pretrained(
        policy, dtype=torch.float64, attn_implementation="eager"
    )
    truth, truth_ent = _truth(m64, ids, mask, 5, temperature=0.9)
    with torch.no_grad():
        trl_lp, trl_ent, _ = trl_tr._get_per_token_logps_and_entropies(
            trl_tr.model, ids, mask, 5, compute_entropy=True
        )
        lp, ent, _ = tree_tr._get_per_token_logps_and_entropies(
            tree_tr.model, ids, mask, 5, compute_entropy=True
        )
    own = (trl_lp.double() - truth).abs().max().item()
    assert (lp.double() - truth).abs().max().item() <= 4 * own + 1e-6
    own_ent = (trl_ent.double() - truth_ent).abs().max().item()
    assert (ent.double() - truth_ent).abs().max().item() <= 4 * own_ent + 1e-6
    assert truth.abs().max() > 0.5  # real log-probs, not a degenerate all-zero batch
