"""What the benchmarks report about the machine: its description, and CPU time from /proc."""

from __future__ import annotations

import os
import platform
import sys

import torch


def describe() -> str:
    """CPU, cores, torch, Python and kernel, the command line and the load average, as markdown bullets."""
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else platform.processor()
    return (
        f"- cpu: {cpu}, {os.cpu_count()} cores\n- torch: {torch.__version__}, CPython {platform.python_version()}, "
        f"{platform.system()} {platform.release()}\n- command: `python {' '.join(sys.argv)}`\n"
        f"- load average at start (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


def busy_ticks() -> int:
    """Busy CPU time of the whole machine so far, in clock ticks (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4]


def ticks_of(pids) -> int:
    """User + system CPU time of these processes so far, in clock ticks."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime and stime: fields 14 and 15 of proc(5)
    return total
