#!/usr/bin/env python3
"""Profiles the raw bus with perf: one nginx with WORKERS workers (1), worker
0 publishing PAYLOAD ("100" or "10k") events to "all" as fast as
overflow = "wait" allows; `perf record` samples worker 0 for SECONDS (3)
and the top symbols are printed, with the events/s reached.

    python3 bench/events/profile.py 10k

Not part of `make bench-events`; a tool for finding where the bus spends
its time (needs perf).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run  # noqa: E402


def main():
    size = sys.argv[1] if len(sys.argv) > 1 else "10k"
    workers = int(os.environ.get("WORKERS", "1"))
    seconds = float(os.environ.get("SECONDS", "3"))
    n = run.make_nginx("loom", workers, {
        "mode": "sat", "payload": size, "duration": seconds + 1,
        "stamp": True})
    data = os.path.join(tempfile.mkdtemp(prefix="loom-perf-"), "perf.data")
    try:
        n.start()
        run.wait_ready(n)
        pid = n.worker_pids()[0]
        run.ctl(n, go=1)
        time.sleep(0.5)     # past the cost phase
        subprocess.run(["perf", "record", "-q", "-p", str(pid), "-o", data,
                        "--", "sleep", str(seconds)], check=True,
                       capture_output=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            st = run.stats(n)
            w0 = st["workers"]["0"]
            if w0.get("ended") and all(
                    (w.get("recv") or 0) >= (w0.get("accepted") or 0)
                    for w in st["workers"].values()):
                break
            time.sleep(0.5)
        base = st.get("sat_base") or 0
        sent = (w0.get("accepted") or 0) - base
        last = max(w.get("recv_at") or 0 for w in st["workers"].values())
        print(json.dumps({"payload": size, "workers": workers,
                          "events": sent, "events_per_s":
                          round(sent / max(1e-9, last - w0["started"]))}))
    finally:
        n.stop()
        n.cleanup()
    rep = subprocess.run(["perf", "report", "-i", data, "--no-children",
                          "--sort", "dso,symbol", "--stdio"],
                         capture_output=True, text=True).stdout
    lines = [ln for ln in rep.splitlines()
             if ln.strip() and not ln.startswith("#")]
    print("\n".join(lines[:20]))


if __name__ == "__main__":
    main()
