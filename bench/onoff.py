"""A module's tax on req/s, measured by switching it on and off while one
wrk run goes on (bench/timer/tax.py, bench/events/tax.py).

Why: on a shared 2-vCPU host the req/s of separate runs move by 10-50 %
from one minute to the next, so the ratio of two runs some seconds apart
cannot rank variants whose tax differs by a few points. Here one nginx
serves `wrk -t1 -c64` for the whole cell while the module under test is
switched off and on in turn (phases of a few seconds, starting and ending
off). After each switch has been applied and `settle` seconds have passed,
the requests served over `window` seconds are counted (stub_status). An
on-phase is compared with the mean of the off-phases either side of it;
the figure is the median of these ratios. Drift slower than a phase
cancels out; what is left is the module's share of the workers' CPU under
load."""

import statistics
import subprocess
import time
import urllib.request


def served(status_url):
    """Requests served so far (stub_status) and the monotonic clock."""
    with urllib.request.urlopen(status_url, timeout=10) as r:
        body = r.read().decode()
    # "Active connections: N\nserver accepts handled requests\n a b c\n..."
    return int(body.splitlines()[2].split()[2]), time.monotonic()


def cpu_jiffies():
    """(steal, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[7], sum(v[:8])


def run(url, status_url, switch, phases, settle, window, on_phase=None):
    """wrk on url for the whole cell; switch(on) applies a phase (and
    returns once every worker has); on_phase(on) is called right after the
    settle time, and what the function it returns gives after the window
    goes into the phase. Returns (phases, ratios)."""
    per_phase = settle + window + 1
    w = subprocess.Popen(
        ["wrk", "-t1", "-c64", "-d%ds" % int(per_phase * phases + 10), url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    try:
        time.sleep(2)
        for k in range(phases):
            on = k % 2 == 1
            switch(on)
            time.sleep(settle)
            after = on_phase(on) if on_phase else None
            r0, t0 = served(status_url)
            s0 = cpu_jiffies()
            time.sleep(window)
            r1, t1 = served(status_url)
            s1 = cpu_jiffies()
            phase = {"on": on, "rps": (r1 - r0) / (t1 - t0),
                     "steal_pct": 100.0 * (s1[0] - s0[0])
                     / max(1, s1[1] - s0[1])}
            if after:
                phase.update(after())
            out.append(phase)
            if w.poll() is not None:
                raise RuntimeError("wrk ended early: " + w.stderr.read())
    finally:
        w.terminate()
        w.wait()
    return out, ratios(out)


def ratios(phases):
    out = []
    for k in range(1, len(phases) - 1):
        if phases[k]["on"] and not phases[k - 1]["on"] \
           and not phases[k + 1]["on"]:
            base = (phases[k - 1]["rps"] + phases[k + 1]["rps"]) / 2
            out.append(phases[k]["rps"] / base)
    return out


def summary(cells):
    """The median on/off ratio of the cells' pairs, quartiles, pairs, and
    the median req/s on and off."""
    rs = [x for c in cells for x in c["ratios"]]
    on = [p["rps"] for c in cells for p in c["phases"] if p["on"]]
    off = [p["rps"] for c in cells for p in c["phases"] if not p["on"]]
    if not rs:
        return None
    q = statistics.quantiles(rs, n=4) if len(rs) > 1 else [rs[0]] * 3
    return {"median_ratio": statistics.median(rs), "q1": q[0], "q3": q[2],
            "pairs": len(rs), "median_rps_on": statistics.median(on),
            "median_rps_off": statistics.median(off),
            "median_steal_pct": statistics.median(
                p["steal_pct"] for c in cells for p in c["phases"])}


def add_args(ap, out):
    """The options every tax.py has; out: the default results file."""
    ap.add_argument("--table", action="store_true",
                    help="print the markdown table of --out and exit")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds, the variants' order reversed in every "
                         "other one (default 2)")
    ap.add_argument("--phases", type=int, default=21,
                    help="phases per cell, off and on in turn, starting "
                         "and ending off: odd, at least 3 (default 21)")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds after a switch before counting "
                         "(default 0.5)")
    ap.add_argument("--window", type=float, default=1.5,
                    help="seconds counted per phase (default 1.5)")
    ap.add_argument("--out", default=out,
                    help="results file (default %s)" % out)


def check_args(ap, args):
    if args.phases < 3 or args.phases % 2 == 0:
        ap.error("--phases must be odd and at least 3")
    if args.rounds < 1 or not args.settle > 0 or not args.window > 0:
        ap.error("--rounds, --settle and --window must be positive")
