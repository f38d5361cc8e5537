"""glibc's allocator set so that memory freed after large requests goes back to the operating system.

glibc serves a request below its *mmap threshold* from a heap that it rarely shrinks, and it raises that threshold
(up to 32 MiB) each time a large block is freed: after a burst of large images, the decoded images, tensors and
PNGs of later requests come from heaps that then stay at their peak. A fixed threshold of :data:`MMAP_THRESHOLD`
keeps every large block in its own mapping, unmapped when freed (small objects are unaffected), so the service
returns to its idle footprint after the burst (``unroll bench memory`` measures it). The cost is a page fault per
touched page of each large block, small next to the work done on it.

:func:`env` is for processes we start (tritonserver and its Python-backend stubs read it at start);
:func:`apply` sets the same in a running process (the gateway). Both are no-ops outside glibc.
"""

from __future__ import annotations

import ctypes

#: Allocations of this many bytes or more get their own mapping (glibc's default starts at 128 KiB but grows).
MMAP_THRESHOLD = 256 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt parameter numbers from glibc's malloc.h


def env() -> dict[str, str]:
    """Environment variables giving a new process the fixed threshold (setting it also stops glibc moving it)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def apply() -> bool:
    """Set the fixed threshold in this process; ``False`` where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
