import os
import tempfile
import warnings

import pytest
import torch

# inductor's on-disk cache (paged_flex's compiled kernel) kept apart per vector ISA: PyTorch 2.13 reuses a kernel
# compiled under one ATEN_CPU_CAPABILITY under another, and it then computes wrong (docs/cpu-support.md)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"hf_paged_cache-inductor-{torch.backends.cpu.get_cpu_capability().lower()}"))

# transformers 5.x warns on every `past_key_values=`; the tests use that spelling on purpose.
warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated", category=FutureWarning)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Run the suite with one intra-op thread, then restore the setting.

    The test models are tiny and gain nothing from threads, while on a busy two-core machine two threads
    spin-wait on each other (a 7x slowdown was measured).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
