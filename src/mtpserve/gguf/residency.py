"""Where a GGUF file's bytes live once opened: llama.cpp's `--no-mmap` and `--mlock` for the reader.

By default the file is mapped (copy-on-write) and its pages come and go with the page cache. `read_into_memory`
copies it into an anonymous mapping instead, the process's own memory, advised for transparent huge pages: 2 MiB
pages where the kernel allows (`madvise` or `always` in /sys/kernel/mm/transparent_hugepage/enabled), which a
file's pages in the page cache mostly cannot have. `lock` pins a mapping's pages in RAM (mlock), faulting them in
first; where RLIMIT_MEMLOCK or the kernel refuses, it warns in llama.cpp's words and the model loads unlocked.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

log = logging.getLogger("mtpserve.gguf")

READ_CHUNK = 64 << 20
MLOCK_ONFAULT = 1  # linux/mman.h


def read_into_memory(fd: BinaryIO, size: int, path: Path) -> mmap.mmap:
    """The file's `size` bytes copied into an anonymous private mapping, logged a quarter at a time."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)
    fd.seek(0)
    done, quarter = 0, 0
    try:
        while done < size:
            n = fd.readinto(view[done : done + READ_CHUNK])
            if not n:
                raise OSError(f"{path}: the file ended at {done} of {size} bytes while being read")
            if hasattr(os, "posix_fadvise"):  # the page cache's copy of what is now ours: let it go first
                os.posix_fadvise(fd.fileno(), done, n, os.POSIX_FADV_DONTNEED)
            done += n
            if size >= 4 * READ_CHUNK and done * 4 >= (quarter + 1) * size:
                quarter = done * 4 // size
                log.info("llama_model_load: read %3d%% of %.1f MiB into memory (--no-mmap)", 25 * quarter, size / 2**20)
    finally:
        view.release()
    return buf


def lock(buf: mmap.mmap) -> None:
    """Pin the mapping's pages in RAM, or warn in llama.cpp's words where that is refused. Its pages are read in
    first, a byte each, then locked as they are and as any later fault brings them (mlock2's MLOCK_ONFAULT): a
    plain mlock would fault a private file mapping's pages in for writing and copy them all."""
    np.frombuffer(buf, dtype=np.uint8)[:: mmap.PAGESIZE].max(initial=0)  # fault every page in, read-only
    libc = ctypes.CDLL(None, use_errno=True)
    address, size = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(buf))), ctypes.c_size_t(len(buf))
    locked = libc.mlock2(address, size, MLOCK_ONFAULT) if hasattr(libc, "mlock2") else libc.mlock(address, size)
    if locked != 0:
        log.warning(
            "warning: failed to mlock %d-byte buffer: %s\nTry increasing RLIMIT_MEMLOCK ('ulimit -l' as root).",
            len(buf),
            os.strerror(ctypes.get_errno()),
        )
