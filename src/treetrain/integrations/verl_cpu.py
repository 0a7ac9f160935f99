"""verl on the CPU (tests, debugging without an accelerator): a ``cpu`` platform in verl's platform
registry.

verl 0.9.1 has no CPU platform: on a machine without an accelerator it falls back to ``nvidia`` and
its FSDP engine calls ``torch.cuda.set_device``. verl picks its platform once per process, the first
time anything asks (``verl.plugin.platform.get_platform``): ``VERL_PLATFORM`` names it, else the
first registered platform whose probe finds its hardware. Its engine module reads the platform
when it is imported (``verl.workers.engine.fsdp.transformer_impl.device_name``), and
``treetrain.integrations.verl``, which ``import verl`` loads through the ``verl.plugins`` entry
point in every process, imports that module: so the ``cpu`` platform is registered by
``treetrain.integrations.verl`` itself (:func:`register_cpu_platform`) before it imports verl's
engine, and chosen by ``VERL_PLATFORM=cpu``. The probe never picks it (a GPU machine's CPU-only Ray
actors stay ``nvidia``).

Two ways to turn it on, in every process (Ray workers inherit the driver's environment):

- ``VERL_PLATFORM=cpu`` in the environment before Python starts;
- :func:`use_cpu_platform` before anything imports verl's engine (it sets ``VERL_PLATFORM``).

Then ``get_device_name()`` is ``'cpu'``, verl's engine module holds ``device_name == 'cpu'``, and
treetrain's engines (registered for ``cpu``) build through verl's registry: ``strategy=treetrain``.
verl's own FSDP2 engine classes also run on the CPU when built directly (the tests do), but verl
registers them for ``cuda`` and ``npu`` only, so ``strategy=fsdp2`` does not resolve on the CPU.

This module imports no verl at import time: :func:`register_cpu_platform` builds the platform class
on its first call (verl's base class lives in the package whose import loads this plugin).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

__all__ = ["register_cpu_platform", "use_cpu_platform"]

PLATFORM = "cpu"


class _CPUDeviceModule:
    """``torch.cpu`` plus what verl calls on an accelerator's device module that ``torch.cpu`` lacks:
    the RNG state (verl's checkpoints save and restore ``rng[device_name]``: here the CPU
    generator), seeds, and cache and memory calls (no-ops and zeros: host memory is not pooled)."""

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def get_device_name(self, device=None):
        return "cpu"

    def empty_cache(self):
        pass

    def ipc_collect(self):
        pass

    def reset_peak_memory_stats(self, device=None):
        pass

    def set_per_process_memory_fraction(self, fraction, device=None):
        pass

    def memory_allocated(self, device=None):
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def mem_get_info(self, device=None):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


_DEVICE_MODULE = _CPUDeviceModule()


class _CPUMethods:
    """The host CPU as a verl platform: device ``cpu``, gloo collectives, Ray resource ``CPU``."""

    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: _DEVICE_MODULE)

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return False  # never auto-detected: VERL_PLATFORM=cpu picks it

    def current_device(self):
        return "cpu"  # verl moves batches with .to(get_device_id())

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_resource_options(self, num_gpus):
        return {}

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def rollout_env_vars(self):
        return {}

    def get_collective_module(self):
        return torch.distributed

    def cudart(self):
        return None


def register_cpu_platform() -> type:
    """The ``cpu`` platform class, registered in verl's ``PlatformRegistry`` on the first call."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    cls = PlatformRegistry.get(PLATFORM)
    if cls is None:
        cls = type("PlatformCPU", (_CPUMethods, PlatformBase), {"__module__": __name__})
        PlatformRegistry.register(platform=PLATFORM)(cls)
    return cls


def _chosen_platform() -> str | None:
    """The device of the platform verl has already chosen in this process, or None (imports nothing)."""
    manager = sys.modules.get("verl.plugin.platform.platform_manager")
    current = getattr(manager, "_current_platform", None)
    return None if current is None else current.device_name


def use_cpu_platform() -> None:
    """Make verl choose the CPU in this process (and in the processes it starts, through
    ``VERL_PLATFORM``). Call it before anything imports verl's engines; a ``ValueError`` says so
    if verl has already chosen another platform (its engine module would keep that device)."""
    chosen = _chosen_platform()
    if chosen not in (None, PLATFORM):
        raise ValueError(
            f"verl already chose the {chosen!r} platform in this process; call use_cpu_platform() before "
            "importing verl's engines, or set VERL_PLATFORM=cpu in the environment before starting Python"
        )
    os.environ["VERL_PLATFORM"] = PLATFORM
    import verl  # noqa: F401  (its plugins: treetrain.integrations.verl registers the platform and engines)

    register_cpu_platform()  # where plugins are off (VERL_USE_EXTERNAL_PLUGINS=none)
