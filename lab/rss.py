"""rss: this process's peak resident memory over a stretch of code — the kernel's high-water mark
(VmHWM) reset through /proc/self/clear_refs where allowed, else a sampling thread — for the streaming
load's bound (tests/test_checkpoint_stream.py, lab/checkpoint_bench.py). Linux only."""
from __future__ import annotations

import threading
import time


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss() -> int:
    return _status("VmRSS")


class PeakRSS:
    """`with PeakRSS() as p: ...` then p.start (RSS before), p.peak, p.growth (peak − start) in bytes,
    p.method ("VmHWM" or "sampled")."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.peak, self.method = interval_s, 0, "VmHWM"
        self._stop = threading.Event()

    def __enter__(self):
        self.start = rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                     # resets VmHWM to the current RSS
            self._thread = None
        except OSError:
            self.method = "sampled"
            self.peak = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval_s)

    def __exit__(self, *exc):
        if self._thread is None:
            self.peak = _status("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start
