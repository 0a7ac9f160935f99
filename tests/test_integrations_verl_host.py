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
        pytest.param("import verl\n" + TRAINER_MODULES, {"VERL_PLATFORM": "cpu"}, id="environment"),
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
        # in the script, before verl is imported (plugins off: it loads the engines itself)
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
