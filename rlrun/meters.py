"""Per-phase wall time and peak memory.

Peak memory: on CUDA the allocator's peak, reset at each phase start; on CPU the process peak RSS (VmHWM), reset
by writing 5 to /proc/self/clear_refs (Linux). `growth` is the peak minus what was in use when the phase began:
on CPU the process baseline (libraries, model) dominates the peak, so growth is what tells phases apart.
Where the reset is refused, the CPU peak is the process peak so far, and `peak_resets` is False so the numbers
are not mistaken for per-phase ones.

PHASES names the phases of a step, in the order the report draws them; a Meter refuses any other name, so a
misspelled phase fails at once instead of logging a metric no figure shows. A phase the run does not have (`skip`:
the offload phases with offload=off) runs unmetered, so no metric and no chart says it took time or memory. torch
is imported only on CUDA paths, so that reading PHASES and the metric keys (the report does) costs no torch import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIB = 2**20
PHASES = ("sync", "wait", "generate", "offload", "old_logprobs", "ref_logprobs", "onload", "train", "eval")
OFFLOAD_PHASES = ("offload", "onload")  # only with offload=on: with offload=off they move nothing


LOAD_KEY = "host/load_1m"  # the 1-minute load average (os.getloadavg) at each step's end: logged with every step


def time_key(phase: str) -> str:
    return f"time/{phase}_s"


def peak_key(phase: str) -> str:
    return f"mem/{phase}_peak_mib"


def growth_key(phase: str) -> str:
    return f"mem/{phase}_growth_mib"


def plan_growth_key(phase: str) -> str:
    """The memory plan's prediction of growth_key(phase) (rlrun/plan/)."""
    return f"plan/{phase}_growth_mib"


def plan_peak_key(phase: str) -> str:
    return f"plan/{phase}_peak_mib"


def proc_bytes(path: str, key: str) -> int:
    """A `key:  N kB` line of a /proc file, in bytes (0 where absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_peak_bytes() -> int:
    return proc_bytes("/proc/self/status", "VmHWM")


def _rss_bytes() -> int:
    return proc_bytes("/proc/self/status", "VmRSS")


def _load_libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _load_libc()


def _release_free_heap() -> None:
    """Hand memory that is free but still held by the allocator back to the OS (glibc malloc_trim), so that
    RSS measures live memory: otherwise, after earlier jobs of a sweep in the same process, a phase reuses pages
    that are already resident and its growth reads as zero."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 2**20


def _fix_mmap_threshold() -> None:
    """Serve every allocation of 1 MiB or more (tensors, tiles) from its own mapping, returned to the OS when
    freed, so that RSS follows the live tensors as CUDA's allocated bytes do. glibc's default raises the threshold
    up to 32 MiB as large blocks are freed, and blocks under it then stay in the heap: measured up to +40 MiB of
    phase growth with 8 MiB head tiles, varying from step to step. Costs nothing measurable on the default run."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _reset_rss_peak() -> bool:
    _release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cuda():
    import torch  # here, not at the top: see the module docstring

    return torch.cuda


class Meter:
    def __init__(self, device: torch.device, phases: tuple[str, ...] = PHASES, skip: tuple[str, ...] = ()):
        self.cuda = device.type == "cuda"
        self.device = device
        self.phases = phases
        self.skip = skip
        if not self.cuda:
            _fix_mmap_threshold()
        self.peak_resets = True if self.cuda else _reset_rss_peak()
        self.new_step()

    def new_step(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.peak: dict[str, int] = {}
        self.growth: dict[str, int] = {}  # peak minus memory in use when the phase started

    def reset_peak(self):
        if self.cuda:
            _cuda().synchronize(self.device)
            _cuda().reset_peak_memory_stats(self.device)
        else:
            self.peak_resets = _reset_rss_peak() and self.peak_resets

    def current(self) -> int:
        return _cuda().memory_allocated(self.device) if self.cuda else _rss_bytes()

    def read_peak(self) -> int:
        if self.cuda:
            _cuda().synchronize(self.device)
            return _cuda().max_memory_allocated(self.device)
        return _rss_peak_bytes()

    @contextmanager
    def phase(self, name: str):
        if name not in self.phases:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(self.phases)} (rlrun.meters.PHASES)")
        if name in self.skip:
            yield
            return
        self.reset_peak()
        base = self.current()
        start = time.perf_counter()
        try:
            yield
        finally:
            peak = self.read_peak()
            self.seconds[name] += time.perf_counter() - start
            self.peak[name] = max(self.peak.get(name, 0), peak)
            self.growth[name] = max(self.growth.get(name, 0), peak - base)

    def metrics(self) -> dict[str, float]:
        out = {time_key(k): v for k, v in self.seconds.items()}
        out.update({peak_key(k): v / MIB for k, v in self.peak.items()})
        out.update({growth_key(k): v / MIB for k, v in self.growth.items()})
        out["time/step_s"] = sum(self.seconds.values())
        return out
