"""What the CUDA allocator backend means for recordings."""
from kiln.compiler.graphs.allocator import (MALLOC_ASYNC, MEMORY_NOTE, NATIVE, allocator_backend, allocator_note,
                                            shares_pool)


def test_native_shares_one_pool_and_says_nothing():
    assert shares_pool(NATIVE) and allocator_note(NATIVE) == ""


def test_malloc_async_says_what_to_do():
    assert not shares_pool(MALLOC_ASYNC)
    assert allocator_note(MALLOC_ASYNC) == MEMORY_NOTE and "--disable-cuda-malloc" in MEMORY_NOTE


def test_backend_is_one_of_torchs():
    assert allocator_backend() in (NATIVE, MALLOC_ASYNC)
