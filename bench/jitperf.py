"""Where a worker's CPU goes, trace by trace: samples of `perf record -e
cpu-clock` mapped onto LuaJIT's own trace dump (jit.dump with machine code,
written by the same process), so that a sample in compiled code is counted
for the trace it fell in, and one elsewhere for its symbol (perf report).

  shares(dump_path, perf_data) -> [(where, fraction)], largest first

A trace is named by its number and where it starts ("trace 11
timer.lua:248"); a side trace says its parent and exit ("(6/17)").
"""

import collections
import re
import subprocess


def trace_ranges(dump_path):
    """[(first, last, name)] of each trace's machine code in the dump."""
    ranges, starts = [], {}
    cur = lo = hi = None
    with open(dump_path, errors="replace") as f:
        for line in f:
            m = re.match(r"---- TRACE (\d+) start (.*)", line)
            if m:
                starts[m.group(1)] = m.group(2).strip()
                continue
            m = re.match(r"---- TRACE (\d+) mcode", line)
            if m:
                cur, lo, hi = m.group(1), None, None
                continue
            if cur is not None and line.startswith("---- TRACE"):
                if lo is not None:
                    ranges.append((lo, hi, "trace %s %s" % (
                        cur, starts.get(cur, "?"))))
                cur = None
                continue
            if cur is not None:
                m = re.match(r"([0-9a-f]{8,})\s", line)
                if m:
                    a = int(m.group(1), 16)
                    lo = a if lo is None else min(lo, a)
                    hi = a if hi is None else max(hi, a)
    return sorted(ranges)


def shares(dump_path, perf_data):
    ranges = trace_ranges(dump_path)
    out = subprocess.run(["perf", "script", "-i", perf_data, "-F",
                          "ip,sym"], capture_output=True, text=True,
                         check=True).stdout
    counts = collections.Counter()
    total = 0
    for line in out.splitlines():
        parts = line.split(None, 1)
        if not parts:
            continue
        total += 1
        ip = int(parts[0], 16)
        for lo, hi, name in ranges:
            # the last instruction's length is not in the dump: 16 bytes
            if lo <= ip <= hi + 16:
                counts[name] += 1
                break
        else:
            sym = parts[1].strip() if len(parts) > 1 else "?"
            counts[sym if sym and sym != "[unknown]" else "other"] += 1
    if not total:
        return []
    return [(k, v / total) for k, v in counts.most_common()]
