"""Small measures shared by the growth curves: percentiles, a process's memory, and the slope
of a curve on log-log axes (the exponent b of y ~ x^b: 0 = flat, 1 = linear)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence


def percentile_ms(seconds: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1, nearest rank) of latencies in seconds, in milliseconds."""
    if not seconds:
        return 0.0
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


def memory_of(pid: int | str = "self") -> tuple[int, int]:
    """(resident bytes now, peak resident bytes) of a process, from /proc (Linux; 0s elsewhere).

    VmRSS and VmHWM rather than getrusage: they can be read for another process (the server)
    and the current value, not only the peak, is what an index costs at rest.
    """
    values = {"VmRSS:": 0, "VmHWM:": 0}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                fields = line.split()  # "VmRSS:", "1234", "kB"
                if fields and fields[0] in values:
                    values[fields[0]] = int(fields[1]) * 1024
    except OSError:
        pass
    return values["VmRSS:"], values["VmHWM:"]


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none): a figure measured
    while other work ran is read as a ratio, not as an absolute."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of log(y) on log(x): y grows as x^slope. None with fewer than two
    positive points. A cost per operation with slope 0 does not grow; a total (memory, start-up
    time) with slope 1 grows linearly; above 1 is worse than linear."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    if var == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / var


def cpu_seconds_of(pid: int | str = "self") -> float:
    """User + system CPU seconds a process has used, from /proc/PID/stat (0.0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            text = stat.read()
    except OSError:
        return 0.0
    # The command name (field 2) may hold spaces; fields after its closing ")" are plain.
    fields = text[text.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of the line
    return ticks / os.sysconf("SC_CLK_TCK")
