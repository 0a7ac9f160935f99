"""A GRPO ``train_batch`` in verl: verl's own FSDP2 engine vs treetrain's (``strategy=treetrain``).

One process (world size 1), one random-init Qwen3-shaped model saved to a temporary folder and loaded
by both engines through verl's own config classes. The batch is verl's: ``--prompts`` prompts of
``P`` tokens with ``n`` sampled responses each, response lengths uniform in ``[C/2, C]``, padded as a
rollout and converted by ``verl.workers.utils.padding.left_right_2_no_padding`` as verl's trainer does.
Each engine runs ``train_batch`` with ``verl.workers.utils.losses.ppo_loss`` (GRPO: one advantage per
sample, token-mean, no entropy term): forward, backward, optimizer step. ``max_token_len_per_gpu`` is
the batch's row tokens, so each engine runs one micro-batch. Modes alternate; each time is the best
of ``--repeats`` after a warm-up (the step least disturbed by other load on a shared machine).

The bound counts what each engine computes (``treetrain.trees.flops``: decoder FLOPs per token run,
attention per query-key pair computed, the LM head per position scored; x3 for forward + backward):

- verl: every row token through the decoder and the head (log-probs at every position); attention
  pairs: on CUDA flash-attention varlen, causal per row; on the CPU SDPA over the packed micro-batch
  with transformers' block-diagonal mask, i.e. all ``N^2`` scores of the ``N`` packed tokens;
- tree: the distinct tokens; the tree's allowed pairs (blocksparse on the CPU, triton/flex on CUDA);
  the head once per distinct (context, label) pair.

``efficiency = speedup / bound``.

Usage::

    python benchmarks/verl_engine.py --quick            # a CPU check (P=256, n=4, C=32)
    python benchmarks/verl_engine.py --write            # the sweep (a GPU): P 1k-4k, n 8/16, C 64-512
    python benchmarks/verl_engine.py --quick --clock cpu  # on a shared, loaded CPU: CPU seconds, 1 thread
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_allocator_flag, hardware, result_path, use_allocator  # noqa: E402

MODELS = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=32000),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
}  # fmt: skip


def build_engines(path: str, device: str):
    """verl's ``FSDPEngineWithLMHead`` and treetrain's, same model folder, same configs."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    attn = "sdpa" if device == "cpu" else "flash_attention_2"
    engines = {}
    for mode in ("verl", "tree"):
        mc = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": attn})
        ec = FSDPEngineConfig(
            strategy="fsdp2",
            use_torch_compile=device != "cpu",
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
            if device == "cpu"
            else None,  # verl's default on GPUs: bf16 parameters, fp32 reduction
        )
        args = (mc, ec, FSDPOptimizerConfig(lr=1e-6, total_training_steps=10**6), CheckpointConfig())
        if mode == "tree":
            object.__setattr__(ec, "strategy", "treetrain")  # as verl's actor config syncs its strategy
            engine = EngineRegistry.new("language_model", "treetrain", *args)
        else:
            engine = FSDPEngineWithLMHead(*args)
        engine.initialize()
        engines[mode] = engine
    return engines


def make_batch(prompts: int, P: int, n: int, C: int, vocab: int, seed: int = 0):
    """verl's no-padding ``TensorDict`` for ``prompts x n`` rows, and the rows' token lists."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    B = prompts * n
    prompt_ids = torch.randint(1, vocab, (prompts, P), generator=g).repeat_interleave(n, 0)
    lens = torch.randint(C // 2, C + 1, (B,), generator=g)
    responses = torch.randint(1, vocab, (B, C), generator=g)
    rmask = (torch.arange(C)[None] < lens[:, None]).long()
    responses = responses * rmask
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), rmask], 1)
    adv = torch.randn(B, 1, generator=g).expand(B, C) * rmask
    td = TensorDict(
        dict(prompts=prompt_ids, responses=responses, input_ids=torch.cat([prompt_ids, responses], 1),
             attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
             response_mask=rmask, old_log_probs=-2.0 * rmask.float(), advantages=adv.contiguous()),
        batch_size=[B],
    )  # fmt: skip
    td = left_right_2_no_padding(td)
    tokens = int(attention.sum())
    meta = dict(temperature=1.0, global_batch_size=B, use_remove_padding=True, calculate_entropy=False)
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=tokens, **meta)
    rows = [torch.cat([prompt_ids[b], responses[b, : lens[b]]]).tolist() for b in range(B)]
    return td, rows


def bounds(rows, cfg, device: str) -> dict:
    """Training FLOPs of each engine's step and the bound (see the module docstring)."""
    from treetrain.integrations.verl_rows import RowTree
    from treetrain.trees.flops import CostModel, Work, baseline_pairs, tree_pairs
    from treetrain.trees.tree import TrajectoryTree

    tree = TrajectoryTree.from_paths(rows)
    values = torch.tensor([t for r in rows for t in r])
    offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    pairs_scored = RowTree.build(values, offsets).src.numel()
    N = tree.num_path_tokens
    verl_pairs = baseline_pairs(tree) if device == "cuda" else N * N
    cost = CostModel.from_config(cfg)
    verl = Work(tokens=N, pairs=verl_pairs, targets=N).flops(cost)
    tree_f = Work(tokens=tree.num_tokens, pairs=tree_pairs(tree), targets=pairs_scored).flops(cost)
    return {"bound": verl / tree_f, "path_tokens": N, "tree_tokens": tree.num_tokens}


def timed(fn, device: str, clock=time.perf_counter) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = clock()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return clock() - t


def run_case(engines, cfg, P, n, C, prompts, repeats, device, clock=time.perf_counter) -> dict:
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    actor = FSDPActorConfig(strategy="fsdp2", rollout_n=n, use_dynamic_bsz=True, loss_agg_mode="token-mean")
    loss_fn = functools.partial(ppo_loss, config=actor)
    _, rows = make_batch(prompts, P, n, C, cfg.vocab_size)
    times = {m: [] for m in engines}

    def step(mode):
        td, _ = make_batch(prompts, P, n, C, cfg.vocab_size)
        with engines[mode].train_mode():
            return timed(lambda: engines[mode].train_batch(td, loss_fn), device, clock)

    for mode in engines:  # warm-up
        step(mode)
    for _ in range(repeats):
        for mode in engines:
            times[mode].append(step(mode))
    row = {"P": P, "n": n, "C": C, "verl": min(times["verl"]), "tree": min(times["tree"])}
    row.update(bounds(rows, cfg, device))
    row["speedup"] = row["verl"] / row["tree"]
    row["efficiency"] = row["speedup"] / row["bound"]
    return row


def table(rows: list[dict]) -> str:
    head = (
        "| P | n | C | row tokens | tree tokens | verl step s | tree step s | speedup | bound "
        "| efficiency |\n|" + "---|" * 10 + "\n"
    )
    lines = [
        f"| {r['P']} | {r['n']} | {r['C']} | {r['path_tokens']} | {r['tree_tokens']} | {r['verl']:.3f} | "
        f"{r['tree']:.3f} | {r['speedup']:.2f}x | {r['bound']:.2f}x | **{r['efficiency']:.2f}** |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 16], help="samples per prompt (n)")
    ap.add_argument("--response-lens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--prompts", type=int, default=1, help="prompts per batch (rows = prompts x n)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="one small case (P=256, n=4, C=32): a CPU check")
    ap.add_argument("--write", action="store_true", help="write the table to benchmarks/results/")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU seconds on one thread (a shared, loaded CPU machine; not for GPUs)",
    )
    add_allocator_flag(ap)
    args = ap.parse_args(argv)
    if argv is None:  # this process is the command: it may re-execute itself under tcmalloc
        use_allocator(args, args.device)
    if args.quick:
        args.prompt_lens, args.groups, args.response_lens, args.repeats = [256], [4], [32], 2
    clock = time.perf_counter
    if args.clock == "cpu":
        if args.device != "cpu":
            raise SystemExit("--clock cpu measures CPU runs only")
        torch.set_num_threads(1)  # no OpenMP spin-waits counted as work
        clock = time.process_time
    import os

    import torch.distributed as dist

    if args.device == "cpu":
        from treetrain.integrations.verl_cpu import use_cpu_platform

        use_cpu_platform()
    import treetrain.integrations.verl  # noqa: F401  (registers strategy=treetrain)

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29617")
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    transformers.logging.set_verbosity_error()
    cfg = transformers.Qwen3Config(
        **MODELS[args.model], max_position_embeddings=8192, tie_word_embeddings=False
    )
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(workdir)
        engines = build_engines(workdir, args.device)
        for n in args.groups:
            for C in args.response_lens:
                for P in args.prompt_lens:
                    rows.append(
                        run_case(engines, cfg, P, n, C, args.prompts, args.repeats, args.device, clock)
                    )
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else hardware()
    import verl

    text = (
        f"# verl GRPO train_batch: strategy=treetrain vs verl's FSDP2 engine ({args.model}, "
        f"{'fp32' if args.device == 'cpu' else 'bf16 mixed precision'}; times: "
        f"{'CPU seconds, one thread' if args.clock == 'cpu' else 'wall seconds'})\n\n"
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device_name}, torch "
        f"{torch.__version__}, verl {verl.__version__}, transformers {transformers.__version__}, command: "
        f"`python benchmarks/{Path(__file__).name} {' '.join(argv if argv is not None else sys.argv[1:])}`"
        "\n\n" + table(rows)
    )
    print(text)
    if args.write:
        md = result_path(f"verl_engine_{args.model}", args.device)
        md.write_text(text)
        print(f"wrote {md}")
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
