"""verl on the CPU (tests, benchmarks, debugging without an accelerator): a ``cpu`` verl platform.

verl 0.9.1 has no CPU platform: on a machine without an accelerator it falls back to ``nvidia``,
and its FSDP engine then calls ``torch.cuda.set_device``. Its platform registry
(``verl.plugin.platform``) is the extension point for other hardware, so :func:`use_cpu_platform`
registers ``cpu`` there (device ``cpu``, gloo collectives). Call it before building an engine, in
every process; verl's engines, configs and losses then run unmodified on the CPU (FSDP2 over gloo),
both verl's own (``strategy=fsdp2``) and treetrain's (``strategy=treetrain``).
"""

from __future__ import annotations

import contextlib
import os

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """The host CPU as a verl platform: device ``cpu``, gloo."""

    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: torch.cpu)

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return True

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


def use_cpu_platform() -> None:
    """Make verl see the CPU (call before building an engine)."""
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    set_platform(PlatformCPU())
