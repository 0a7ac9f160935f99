"""Test-session setup.

Triton decides once, at its first import, whether it runs kernels in its CPU interpreter. Without
CUDA the Triton kernel's tests need the interpreter, so it is switched on here, before any test
module (or treetrain itself) imports triton.

The suite runs in parallel processes (pytest-xdist, ``-n auto`` in pyproject's addopts; ``-n 0``
runs it in one). Each worker then gets an equal share of the cores for torch's intra-op threads,
and so do the processes its tests start (``OMP_NUM_THREADS``), instead of every worker taking them
all and thrashing.
"""

import os

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.distributed.checkpoint logs every save/load at DEBUG (loggers it sets to DEBUG itself), which
# buries a failing test's output; treetrain's CLI quiets them the same way unless --verbose
from treetrain.train.logs import quiet_library_loggers  # noqa: E402

quiet_library_loggers()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny tensors (more threads only add overhead, and thrash
    on a busy machine); the count is restored after the module. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# modules whose tests start process groups (torchrun, mp.spawn, gloo): under xdist they all run on
# one worker, one at a time, so two multi-rank jobs never share the 2 cores (a rank starved that way
# timed out of gloo: "terminate called without an active exception", once per few CI runs).
# Only those: this serial group is CI's longest pole (test_faults.py's and test_parallel_cp_recurrent.py's
# runs are single processes)
_PROCESS_MODULES = {
    f"test_{m}"
    for m in ("distributed", "faults_distributed", "train_distributed", "train_objectives_distributed",
              "parallel_cp", "parallel_cp_train", "integrations_wrapped", "integrations_verl",
              "integrations_verl_host", "integrations_verl_vlm")
}  # fmt: skip


@pytest.hookimpl(trylast=True)  # after xdist's own hook (see below)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in _PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        _group_suffix(items)


def _group_suffix(items) -> None:
    """The ``@GROUP`` suffix of a grouped test's node id, by which xdist's loadgroup scheduler sends a
    group to one worker. xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2's structured node
    ids no longer read: every group was silently spread over the workers (pytest-xdist issue 1386),
    the processes group above and each module whose tests share a module-scoped fixture (set up once
    per worker that got one of them). Added here where xdist's did not take."""
    from _pytest.nodeid import NodeId

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})  # fmt: skip
        nodeid = item.nodeid
        if names and nodeid.rfind("@") <= nodeid.rfind("]"):
            item._id = NodeId.parse(f"{nodeid}@{'_'.join(names)}")  # noqa: SLF001
