"""glibc's allocator for the ``xnn`` command: keep large freed blocks mapped.

A CPU step allocates and frees tensors of tens of MB every step (edge vectors, filters, their
gradients). With glibc's defaults such blocks go back to the kernel when freed and are mapped
again, zero-filled page by page, on the next step: measured on a 2-core VM (LJ, 16k atoms,
one rank, ``docs/lammps.md``), 3.17 M page faults and 6.2 s of system time in a 20-step run,
against 0.72 M and 1.7 s with the settings below. They are what ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` set, applied through ``mallopt`` when the process starts as
the ``xnn`` command; a user who sets either variable (or ``GLIBC_TUNABLES``), or
``XNN_ALLOCATOR=system``, keeps glibc's behaviour. The cost: up to ``TRIM`` bytes of freed
memory stay with the process instead of going back to the system.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: blocks below this many bytes come from the heap (glibc's upper limit for the setting)
MMAP_THRESHOLD = 32 * 1024 * 1024
#: free memory at the heap's top kept mapped (bytes)
TRIM_THRESHOLD = 1024 ** 3  # (mallopt takes a C int: at most 2 GiB - 1)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_large_blocks(environ=os.environ) -> bool:
    """Apply :data:`MMAP_THRESHOLD` and :data:`TRIM_THRESHOLD` to this process's glibc
    allocator; ``False`` (nothing changed) off glibc, when the user set glibc's own
    variables or ``XNN_ALLOCATOR=system``, or when ``mallopt`` refuses."""
    if environ.get("XNN_ALLOCATOR", "") == "system" or any(k in environ for k in _USER_SETTINGS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # both, in this order: setting either turns off glibc's adaptive mmap threshold, and the
    # trim threshold alone made the measured run 3x worse than the defaults
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
