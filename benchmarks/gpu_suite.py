"""The whole GPU check (issue 26) in one command: correctness, kernel speed, end to end, report.

Every result lands under one folder (``--out``, default
``benchmarks/results/gpu-<gpu>-<date>/``): per part a ``results.jsonl`` (one line per finished case)
and a ``state.json`` (status, seconds used); then ``summary.md``, ``kernel_time_vs_T.png`` and
``log.txt``. Each part has a time budget (printed at the start; 1950 s in all) and stops cleanly when
it runs out, recording that; ``--max-seconds`` ends a run before a device call's limit, and
``--resume`` carries on where the last run stopped (finished parts and cases are skipped).

Parts (``benchmarks/gpu/``): 1. ``correctness``: tree attention forward and backward in bf16 and fp16
per backend vs float64, random trees up to 64k tokens, head dims 64/128, GQA; the FLA and torch Gated
DeltaNet paths vs float64 on Qwen3.5-shaped layers; a Qwen3-0.6B-shaped model's log-probs and
gradients vs per-path forwards, each error bounded by the matching per-path/low-precision error.
2. ``kernels``: Triton vs FlexAttention (and flash-attn varlen, if it imports) at T = 4k..64k,
per-turn and group trees, forward + backward, TFLOP/s on allowed pairs and the fraction of dense
causal attention's rate. 3. ``e2e``: Qwen3-0.6B-shaped, bf16 mixed precision, FSDP2 on one GPU, tree
vs the per-path baseline (speedup, FLOP bound, MFU, peak memory, tokens/s). 4. ``verl``: verl's
trainer (``python -m verl.trainer.main_ppo``, vLLM rollout, actor + reference + critic) two steps
with ``strategy=fsdp2`` and with ``strategy=treetrain`` on one seed, step 1's metrics compared
(runs where ``--verl-python`` imports verl and vLLM, else recorded unavailable). 5. ``report``.

On a device lease (10-minute calls; the results folder travels back as one archive)::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --out benchmarks/results/gpu-h100 \\
        --resume --archive $OUT/gpu.tgz        # repeat until it exits 0 or 1 (3: not finished)
    tar xzf <returned>/gpu.tgz -C benchmarks/results    # here, before the next call

flash-linear-attention (FLA) is not in the device image and the device has no network: fetch its
pure-Python wheel here (``echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps
--only-binary=:all: --python-version 3.12 -d .whl fla-core==0.6.0``; it needs only einops, which the
image has), carry ``.whl`` and start the device command with ``python3 -m pip install -q --no-index
--no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site;``. Without it the GDN check
records the FLA path as unavailable. flash-attn has no wheel to carry; its row runs when it imports.

``--dry-run`` prints the GPU plan, then runs every part at tiny sizes on the CPU (the dense backend
in bf16, the Triton kernel in float32 under ``TRITON_INTERPRET=1``): the code, its result files and
the resume rules, checked before a lease is spent (``tests/test_gpu_suite.py``).

Exit status: 0 every part finished with no failed check and no error (the speed goals are judged
in ``summary.md``), 1 a check failed, a case errored or a part ran over its budget, 3 stopped by
``--max-seconds`` (run again with ``--resume``), 2 bad arguments.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # must precede the first import of triton (see test_attention_triton.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's treetrain, tests.reference, benchmarks.gpu

import torch  # noqa: E402

from benchmarks.gpu import correctness, end_to_end, kernels, report, verl_trainer  # noqa: E402
from benchmarks.gpu.runner import EXIT_INCOMPLETE, Part, load_records, print_plan, run_part  # noqa: E402
from benchmarks.gpu.sizes import BUDGETS, Sizes, dry_run_sizes, gpu_sizes  # noqa: E402
from treetrain.bench.report import hardware_slug  # noqa: E402

PARTS = ("correctness", "kernels", "e2e", "verl", "report")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # "--dry-run" is looked for verbatim before the imports (TRITON_INTERPRET)
    )
    p.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results/"
                   "gpu-<gpu>-<date>, or gpu-dryrun-<cpu>-<date> with --dry-run)")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue in --out: skip finished parts and cases")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run, in order")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop cleanly after this many seconds (default on CUDA: 540, inside a 10-minute "
                   "device call); the case in flight is dropped and --resume re-runs it")  # fmt: skip
    p.add_argument("--profile-below", type=float, default=0.95,
                   help="profile a step per mode of each end-to-end case below this efficiency")  # fmt: skip
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    p.add_argument("--verl-python", default=None,
                   help="Python with verl 0.9.1 and vLLM, for the verl part (default: this one)")  # fmt: skip
    p.add_argument("--archive", type=Path, default=None, help="also write the results folder as a .tgz here")
    p.add_argument("--dry-run", action="store_true",
                   help="print the GPU plan, then run every part at tiny sizes on the CPU")  # fmt: skip
    args = p.parse_args(argv)
    if args.max_seconds is None and torch.cuda.is_available() and not args.dry_run:
        args.max_seconds = 540.0
    if args.budget_scale <= 0:
        p.error("--budget-scale must be > 0")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run on a GPU, or pass --dry-run for the CPU dry run")
    return args


def default_out(dry_run: bool) -> Path:
    device = torch.device("cpu" if dry_run else "cuda")
    slug = hardware_slug(device).removeprefix("cuda-")
    name = f"gpu-dryrun-{slug}" if dry_run else f"gpu-{slug}"
    return ROOT / "benchmarks" / "results" / f"{name}-{datetime.date.today().isoformat()}"


def build_parts(
    sizes: Sizes, out: Path, scale: float, header: list[str], e2e_model, verl_python: str | None = None
) -> list[Part]:
    about = {
        "correctness": "attention fwd+bwd per backend and dtype, GDN kernels, model log-probs + grads",
        "kernels": "fwd+bwd time, TFLOP/s, fraction of dense causal attention, per tree kind and T",
        "e2e": "one training step, tree vs per-path baseline, FSDP2 + bf16 mixed precision",
        "verl": "verl's main_ppo, strategy=fsdp2 vs treetrain, step 1 metrics",
        "report": "summary.md and kernel_time_vs_T.png (rewritten every run)",
    }
    plans = {
        "correctness": lambda: correctness.plan(sizes),
        "kernels": lambda: kernels.plan(sizes),
        "e2e": lambda: end_to_end.plan(sizes, e2e_model, out),
        "verl": lambda: verl_trainer.plan(sizes, out, verl_python),
        "report": lambda: report.plan(out, header),
    }
    return [Part(n, BUDGETS[n] * scale, plans[n], always=n == "report", about=about[n]) for n in PARTS]


def describe(sizes: Sizes, dry_run: bool) -> list[str]:
    import transformers

    if sizes.device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        hw = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
            f"CUDA {torch.version.cuda}"
        )
    else:
        hw = f"CPU dry run: {hardware_slug(sizes.device)}, {os.cpu_count()} cores"
    try:
        import triton

        tri = triton.__version__
    except ImportError:
        tri = "not installed"
    return [
        f"# GPU suite{' (dry run, CPU, tiny sizes: numbers are not measurements)' if dry_run else ''}",
        "",
        f"- hardware: {hw}",
        f"- software: torch {torch.__version__}, triton {tri}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    out = (args.out or default_out(args.dry_run)).resolve()
    if not args.resume and any(out.glob("*/state.json")):
        msg = f"{out} holds results of an earlier run: pass --resume to continue it, or another --out"
        print(msg, file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "a") as logf:

        def log(msg: str) -> None:
            print(msg, flush=True)
            logf.write(msg + "\n")
            logf.flush()

        states = run(args, out, log)
    return exit_status(states, out)


def run(args: argparse.Namespace, out: Path, log) -> dict[str, str]:
    """Run the chosen parts; returns each part's status. After a run stopped at ``--max-seconds``
    the report still runs (it is quick), so every call leaves a summary of what is there."""
    t_start = time.monotonic()
    deadline = None if args.max_seconds is None else t_start + args.max_seconds
    if args.dry_run:
        log("GPU plan (what a device run does):")
        for part in build_parts(gpu_sizes(), out, args.budget_scale, [], None):
            ids = [c.id for c in part.plan()]  # cheap: builds the cases, runs nothing
            log(f"  {part.name}: {len(ids)} cases, budget {part.budget_s:.0f} s")
            log("\n".join(f"    {cid}" for cid in ids))
        # tiny sizes gain nothing from threads, and on a shared CPU idle intra-op threads spin
        torch.set_num_threads(1)
        triton_interp = _triton_interpreter()
        sizes = dry_run_sizes(triton_interp)
        log(f"dry run on the CPU at tiny sizes (Triton interpreter: {'on' if triton_interp else 'off'})")
    else:
        sizes = gpu_sizes()
        torch._dynamo.config.cache_size_limit = 64  # FlexAttention compiles once per sequence length
        torch._dynamo.config.accumulated_cache_size_limit = 512
    sizes.profile_below = args.profile_below
    shared_model = end_to_end.Model(sizes)
    header = describe(sizes, args.dry_run)
    parts = build_parts(sizes, out, args.budget_scale, header, shared_model, args.verl_python)
    parts = [p for p in parts if p.name in args.parts]
    print_plan(parts, out, log)
    states: dict[str, str] = {}

    def archive() -> None:
        """The folder as one .tgz, rewritten after every case: a call killed at its time limit
        still returns what it finished."""
        if args.archive:
            args.archive.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.archive.with_name(args.archive.name + ".tmp")
            with tarfile.open(tmp, "w:gz") as tar:
                tar.add(out, arcname=out.name)
            os.replace(tmp, args.archive)

    try:
        for part in parts:
            if "partial" in states.values() and not part.always:
                continue
            states[part.name] = run_part(part, out, None if part.always else deadline, log, archive)
            if part.name == "e2e":
                shared_model.close()  # the process group and the model's memory
    finally:
        shared_model.close()
        log(f"run took {time.monotonic() - t_start:.0f} s; results in {out}")
        archive()
        if args.archive:
            log(f"archive: {args.archive}")
    return states


def _triton_interpreter() -> bool:
    try:
        from treetrain.attention.triton_kernel import triton_available
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_available()


def exit_status(states: dict[str, str], out: Path) -> int:
    if "partial" in states.values():
        print(f"not finished: run again with --resume --out {out}")
        return EXIT_INCOMPLETE
    bad = [p for p, s in states.items() if s == "over_budget"]
    for part in ("correctness", "kernels", "e2e", "verl"):
        if part in states:
            bad += [f"{part}: {r['id']}" for r in load_records(out, part) if r.get("status") != "ok"]
    if bad:
        print("not passed: " + "; ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
