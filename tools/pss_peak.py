"""Peak memory of a command and every process it starts, measured honestly (issue 26).

    python tools/pss_peak.py [--interval S] -- COMMAND ...

Samples, every ``--interval`` seconds while the command runs, ``/proc/PID/smaps_rollup`` of the command's
process and all its descendants, and prints the peak over the samples of:

* ``Pss`` summed over the processes: each page counted once in total (a page shared by k processes
  adds 1/k to each), so a memory-mapped weight or a copy-on-write page a forked worker inherited is not
  counted twice. This is the number that says what the processes cost the machine together;
* ``Rss`` summed (what ``ps`` and ``/usr/bin/time``'s max RSS add up to: a shared page once per process);
* the largest single process's ``Pss`` and ``Rss``;
* ``Anonymous`` summed (memory no file backs: what the processes allocated, copy-on-write copies included;
  the rest of RSS is file pages, e.g. a memory-mapped archive, which the kernel can drop and read again).

Exits with the command's exit code. :func:`sample_tree` is importable (the tests use it)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["children", "rollup", "sample_tree", "PeakSampler", "main"]


def children(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/*/task/*/children; processes gone meanwhile are skipped)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def rollup(pid: int) -> dict[str, int]:
    """``Rss``, ``Pss``, ``Private_*`` ... of ``/proc/pid/smaps_rollup`` in bytes ({} when the process is gone)."""
    got: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    got[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        return {}
    return got


def sample_tree(pid: int) -> dict[str, Any]:
    """One sample: ``pss``/``rss`` summed over ``pid`` and its descendants, the largest process's, and ``n``."""
    rows = [r for r in (rollup(p) for p in children(pid)) if r]
    return {"pss": sum(r.get("Pss", 0) for r in rows), "rss": sum(r.get("Rss", 0) for r in rows),
            "anon": sum(r.get("Anonymous", 0) for r in rows),
            "max_pss": max((r.get("Pss", 0) for r in rows), default=0),
            "max_rss": max((r.get("Rss", 0) for r in rows), default=0), "n": len(rows)}


class PeakSampler:
    """``with PeakSampler(pid) as s: ...`` then ``s.peak``: the per-key maximum of :func:`sample_tree` taken
    every ``interval`` seconds in a thread (``n``: the most processes seen at once)."""

    def __init__(self, pid: int | None = None, interval: float = 0.05) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self.peak: dict[str, int] = {"pss": 0, "rss": 0, "anon": 0, "max_pss": 0, "max_rss": 0, "n": 0}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _take(self) -> None:
        s = sample_tree(self.pid)
        for k, v in s.items():
            self.peak[k] = max(self.peak[k], v)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take()
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between samples (default 0.05)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    with PeakSampler(proc.pid, a.interval) as s:
        rc = proc.wait()
    mib = 1 << 20
    p = s.peak
    print(f"pss_peak: wall {time.perf_counter() - t0:.1f} s, {s.samples} samples, up to {p['n']} processes; "
          f"peak PSS sum {p['pss'] / mib:.0f} MiB, peak RSS sum {p['rss'] / mib:.0f} MiB, largest process "
          f"PSS {p['max_pss'] / mib:.0f} MiB / RSS {p['max_rss'] / mib:.0f} MiB; peak anonymous sum "
          f"{p['anon'] / mib:.0f} MiB", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
