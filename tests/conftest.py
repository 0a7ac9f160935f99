"""Test-session setup.

Triton decides once, at its first import, whether it runs kernels in its CPU interpreter. Without
CUDA the Triton kernel's tests need the interpreter, so it is switched on here, before any test
module (or treetrain itself) imports triton.
"""

import os

import pytest
import torch

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
