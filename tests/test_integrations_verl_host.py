"""verl as its users run it, around the engine: what ``pip install "treetrain[verl]"`` makes importable,
the CPU platform chosen before verl reads it, the plugin in a fresh process (as every Ray worker
imports verl), and the trainer's pieces that run beside ``strategy=treetrain``.

The subprocess cases start a fresh interpreter because verl fixes its platform and loads its plugins
once per process, at ``import verl``: this test process has imported verl already.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl")

HERE = os.path.dirname(__file__)
SRC = os.path.join(HERE, "..", "src")


def fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` (unindented) in a new interpreter, this worktree's treetrain first on the path."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    environ.update(env, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


# ---- the CPU platform, chosen before verl's engine reads it ------------------------------------------

TRAINER_MODULES = textwrap.dedent("""
    import importlib
    for name in ["verl.trainer.main_ppo", "transfer_queue", "verl.trainer.ppo.v1", "verl.trainer.main_ppo_v0",
                 "verl.workers.engine_workers", "verl.experimental.agent_loop", "verl.checkpoint_engine",
                 "verl.experimental.reward_loop", "verl.workers.rollout.llm_server"]:
        importlib.import_module(name)
""")
# what stops verl's trainer on the CPU (docs/guides/verl.md): its workers' process group, whatever the
# platform; when verl accepts the CPU here, the guide's reason is gone and a main_ppo smoke test can follow
WORKER_GROUP = textwrap.dedent("""
    import os
    from verl.utils.distributed import initialize_global_process_group_ray
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29563", RANK="0", WORLD_SIZE="1")
    try:
        initialize_global_process_group_ray()
    except ValueError as e:
        assert "cpu:gloo,cpu:gloo" in str(e), e
    else:
        raise AssertionError("verl's workers now start a process group on the CPU platform")
""")
CHECK_PLATFORM = textwrap.dedent("""
    from verl.plugin.platform.platform_manager import get_platform
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl
    import treetrain.integrations.verl as tv
    assert get_platform().device_name == "cpu", get_platform()
    assert transformer_impl.device_name == "cpu", transformer_impl.device_name  # read once, at import
    assert EngineRegistry.get_engine_cls("language_model", "treetrain") is tv.TreeEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "treetrain") is tv.TreeEngineWithValueHead
""")


@pytest.mark.parametrize(
    "code, env",
    [
        # a Ray worker: a fresh process that imports verl, VERL_PLATFORM inherited, the entry point loads us;
        # then what `python -m verl.trainer.main_ppo` imports when its (V1) task runner runs: plain
        # verl==0.9.1 misses TransferQueue, cachetools, uvicorn (the `verl` extra installs `verl-core`)
        pytest.param(
            "import verl\n" + TRAINER_MODULES + WORKER_GROUP, {"VERL_PLATFORM": "cpu"}, id="environment"
        ),
        # plugins off, loaded by name through verl's external-modules variable
        pytest.param(
            "import verl\n",
            {
                "VERL_PLATFORM": "cpu",
                "VERL_USE_EXTERNAL_PLUGINS": "none",
                "VERL_USE_EXTERNAL_MODULES": "treetrain.integrations.verl",
            },
            id="external-modules",
        ),
        # in the script, before verl is imported (plugins off: the check imports the engines)
        pytest.param(
            "from treetrain.integrations.verl_cpu import use_cpu_platform\nuse_cpu_platform()\nimport verl\n",
            {"VERL_USE_EXTERNAL_PLUGINS": "none"},
            id="function",
        ),
    ],
)
def test_cpu_platform_is_chosen_before_verl_reads_it(code, env):
    proc = fresh(code + CHECK_PLATFORM, **env)
    out = proc.stdout + proc.stderr
    assert "Replacing already-initialised platform" not in out  # chosen once, never replaced
    assert "Falling back to 'nvidia'" not in out


def test_cpu_platform_refuses_a_platform_already_chosen():
    from verl.plugin.platform.platform_manager import get_platform

    from treetrain.integrations.verl_cpu import use_cpu_platform

    if get_platform().device_name == "cpu":  # this process was started with VERL_PLATFORM=cpu
        pytest.skip("verl chose the CPU in this process")
    with pytest.raises(ValueError, match="already chose .* VERL_PLATFORM=cpu"):
        use_cpu_platform()


# ---- the trainer's pieces beside strategy=treetrain -------------------------------------------------


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> dict:
    """tests/verl_host_worker.py on one gloo rank, on the CPU platform (its docstring says what)."""
    out = tmp_path_factory.mktemp("verl_host")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
           os.path.join(HERE, "verl_host_worker.py"), str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    import torch

    return torch.load(out / "host.pt", weights_only=False)


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_checkpoint_round_trip(host):
    """verl's checkpoint manager saves a treetrain engine (model, optimizer, RNG: the CPU platform's
    device module carries the RNG state verl restores) and a new engine resumes it bit for bit."""
    c = host["checkpoint"]
    assert _equal(c["saved"], c["loaded"])
    assert len(c["opt_saved"]) == 3 * len(c["saved"])  # AdamW: step, exp_avg, exp_avg_sq per parameter
    assert all(a.equal(b) for a, b in zip(c["opt_saved"], c["opt_loaded"]))
    assert c["saver_grad_norm"] == c["loader_grad_norm"]  # the same next step, from the loaded state
    assert _equal(c["saver_after"], c["loader_after"])


@pytest.mark.slow
def test_weight_sync_sends_hugging_face_tensors(host):
    """What verl's weight sync hands the rollout (``get_per_tensor_param``): every Hugging Face name
    of the model, full tensors, the engine's current weights (tree attention adds no parameter)."""
    c = host["checkpoint"]
    assert set(c["weights"]) == set(c["hf"])
    assert _equal(c["weights"], c["loader_after"])


@pytest.mark.slow
def test_balance_batch_order_changes_nothing(host):
    """The V1 trainer balances every batch over the data-parallel ranks by length (two ranks here:
    rows [0 1 4 7] and [2 3 5 6], each prompt's samples split between them); whatever order the rows
    arrive in, the engine's log-probs (row for row) and loss are the same, to the bit."""
    import torch

    r = host["reorder"]
    assert sorted(r["order"].tolist()) == list(range(8)) and r["order"].tolist() != list(range(8))
    off = r["offsets"].tolist()
    rows = [r["rollout"][a:b] for a, b in zip(off[:-1], off[1:])]
    assert torch.equal(torch.cat([rows[i] for i in r["order"].tolist()]), r["balanced"])
    assert r["rollout_loss"] == r["balanced_loss"]


@pytest.mark.slow
def test_ulysses_is_refused_by_name(host):
    assert "Ulysses sequence parallelism (ulysses_sequence_parallel_size=2)" in host["ulysses"]


def test_v1_trainer_balances_without_prefix_groups():
    """What the guide tells a user with more than one rank: verl 0.9.1's V1 trainer (the default)
    balances every batch by sequence length and reads neither ``use_prefix_grouper`` nor
    ``trainer.balance_batch``; the legacy trainer (``trainer.use_v1=False``) keeps a prompt's samples
    on one rank with ``use_prefix_grouper=True``."""
    import inspect
    from pathlib import Path

    from verl.trainer.ppo import v1 as trainer_v1
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    v1, v0 = inspect.getsource(PPOTrainer._balance_batch), inspect.getsource(RayPPOTrainer._balance_batch)
    assert "get_seqlen_balanced_partitions" in v1 and "prefix_grouper" not in v1
    for source in Path(trainer_v1.__file__).parent.glob("*.py"):  # the flag is never read
        text = source.read_text()
        assert "trainer.balance_batch" not in text and "use_prefix_grouper" not in text, source.name
    assert "use_prefix_grouper" in v0 and "get_group_balanced_partitions" in v0


def test_gpu_suite_main_ppo_command_is_valid_for_verl(tmp_path):
    """The GPU suite's main_ppo runs (benchmarks/gpu/verl_trainer.py) compose with verl's own Hydra
    config (every override a key verl knows) and pass verl's ``validate_config``, for both strategies:
    what can be checked of them without a GPU."""
    sys.path.insert(0, os.path.join(HERE, ".."))
    try:
        from benchmarks.gpu import verl_trainer
    finally:
        sys.path.pop(0)
    from hydra import compose, initialize_config_dir
    from verl.trainer import main_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from benchmarks.gpu.sizes import TINY_QWEN3

    root = verl_trainer.write_inputs(tmp_path, TINY_QWEN3, prompts=4)
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        for strategy in verl_trainer.STRATEGIES:
            cfg = compose("ppo_trainer", overrides=verl_trainer.overrides(root, strategy))
            assert cfg.actor_rollout_ref.actor.strategy == cfg.critic.strategy == strategy
            assert need_reference_policy(cfg) and need_critic(cfg)  # actor + reference + critic
            validate_config(cfg, use_reference_policy=True, use_critic=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "model")
    chat = [{"role": "user", "content": "12"}]
    ids = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<|user|>", "1", "2", "<|end|>", "<|assistant|>"]
