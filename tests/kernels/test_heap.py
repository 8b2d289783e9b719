"""`pad_heap`: freed memory stays in the process's heap for the next allocation."""

import subprocess
import sys
import textwrap

import pytest

from hf_paged_cache import heap
from hf_paged_cache.heap import MAX_HEAP_PAD, _glibc_mallopt, pad_heap

needs_glibc = pytest.mark.skipif(_glibc_mallopt() is None, reason="the C library is not glibc")

# In a fresh interpreter: free an 8 MiB block and report the free bytes the heap keeps (glibc's mallinfo2).
KEPT_AFTER_FREE = textwrap.dedent("""
    import ctypes, importlib.util, sys

    spec = importlib.util.spec_from_file_location("heap", sys.argv[2])  # the module alone: no torch to import
    heap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heap)

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "padded":
        assert heap.pad_heap(64 * 1024 * 1024)
    block = libc.malloc(8 * 1024 * 1024)
    ctypes.memset(block, 1, 8 * 1024 * 1024)
    libc.free(block)
    print(libc.mallinfo2().fordblks)
""")


def _kept_after_free(mode: str) -> int:
    command = [sys.executable, "-c", KEPT_AFTER_FREE, mode, heap.__file__]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return int(done.stdout)


@needs_glibc
def test_a_padded_heap_keeps_a_freed_block_that_glibc_would_give_back():
    assert _kept_after_free("stock") < 8 * 1024 * 1024  # mapped on its own and unmapped when freed
    assert _kept_after_free("padded") >= 8 * 1024 * 1024  # from the heap, and kept there


@pytest.mark.parametrize("pad", [0, -1, MAX_HEAP_PAD + 1])
def test_pad_heap_refuses_sizes_mallopt_cannot_take(pad):
    with pytest.raises(ValueError, match="pad_bytes"):
        pad_heap(pad)
