#!/usr/bin/env python3
"""The bus's latency at half its saturated rate, next to this host's floor.

    python3 bench/events/floor.py

For 4 workers (on however many cores the host has) and both payloads:
the raw bus benchmark's saturated rate (run.py's "sat" mode), then rounds
that alternate, at half that rate,
  bus   run.py's "lat" mode: worker 0 publishes to "all", p50 / p99 of the
        bus's publish-to-handler latency, worst worker;
  floor floor.c, a C writer and 3 C readers on UNIX sockets with the same
        pacing, burning the CPU per event that the bus's workers used in
        the bus run just before (worker 0's, and the mean of the others');
  half  the same with half that CPU per event: a bus twice as cheap;
  bare  floor.c doing no work per message: the kernel's wake-ups alone.
The floor is what any design costing that much CPU per event would see
here; the bare floor is the wake-up latency no design avoids.

Knobs: REPEAT (3 rounds), BENCH_RAW_DURATION (2 s), BENCH_OUT
(bench/results/events-floor.json). Needs cc (build-essential).
"""

import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402

OUT = os.environ.get("BENCH_OUT", os.path.join(
    run.ROOT, "bench", "results", "events-floor.json"))
WORKERS = 4
# bytes one event takes on the wire: frame header 16 + event header 40 +
# trailer 8 + the encoded body (source, event and the payload table)
WIRE_BYTES = {"100": 190, "10k": 10350}


def build_floor(tmp):
    exe = os.path.join(tmp, "floor")
    subprocess.run(["cc", "-O2", "-o", exe, os.path.join(HERE, "floor.c")],
                   check=True)
    return exe


def floor_run(exe, rate, size, writer_us, reader_us):
    run.wait_quiet(10)
    out = subprocess.run(
        [exe, str(WORKERS - 1), str(rate), str(run.RAW_DURATION),
         str(WIRE_BYTES[size]), "%.3f" % writer_us, "%.3f" % reader_us],
        capture_output=True, text=True, check=True, timeout=120).stdout
    readers = [json.loads(line) for line in out.splitlines() if line]
    return {"writer_us": round(writer_us, 3), "reader_us": round(reader_us, 3),
            "readers": readers,
            "p50_ms": run.med(r.get("p50_ms") for r in readers),
            "p99_ms": max(r.get("p99_ms") or 0 for r in readers)}


def work_of(bus):
    """CPU µs per event of worker 0 and of the others in a bus lat run."""
    cpu = bus["worker_cpu_s"]
    n = bus["accepted"]
    return (1e6 * cpu[0] / n,
            1e6 * sum(cpu[1:]) / len(cpu[1:]) / n)


def main():
    data = {
        "benchmark": "bus latency against the host's floor "
                     "(bench/events/floor.py)",
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "machine": run.machine_info(),
        "params": {"workers": WORKERS, "rounds": run.REPEAT,
                   "seconds": run.RAW_DURATION, "wire_bytes": WIRE_BYTES},
        "cells": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_floor(tmp)
        for size in ("100", "10k"):
            sat = run.raw_run(WORKERS, size, "sat")
            rate = max(1, sat["events_per_s"] // 2)
            cell = {"payload": size, "saturated_per_s": sat["events_per_s"],
                    "rate": rate, "rounds": []}
            work = None
            for rep in range(1, run.REPEAT + 1):
                rnd = {}
                order = ("bus", "floor") if rep % 2 or work is None \
                    else ("floor", "bus")
                for what in order:
                    if what == "bus":
                        rnd["bus"] = run.raw_run(WORKERS, size, "lat",
                                                 rate=rate)
                        work = work_of(rnd["bus"])
                    else:
                        rnd["floor"] = floor_run(exe, rate, size, *work)
                rnd["half"] = floor_run(exe, rate, size,
                                        *(w / 2 for w in work))
                rnd["bare"] = floor_run(exe, rate, size, 0, 0)
                run.log("floor", size, rep, {k: (v.get("p50_ms"),
                                                 v.get("p99_ms"))
                                             for k, v in rnd.items()})
                cell["rounds"].append(rnd)
            for what in ("bus", "floor", "half", "bare"):
                cell[what + "_p50_ms"] = run.med(
                    r[what].get("p50_ms") for r in cell["rounds"])
                cell[what + "_p99_ms"] = run.med(
                    r[what].get("p99_ms") for r in cell["rounds"])
            data["cells"].append(cell)
    data["finished"] = datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(OUT + ".tmp", OUT)
    print("| payload | events/s | bus | floor | half | bare |")
    print("|---|---|---|---|---|---|")
    for c in data["cells"]:
        print("| %s | %d | %s |" % (
            run.PAYLOAD_NAMES[c["payload"]], c["rate"], " | ".join(
                "%s / %s ms" % (c[w + "_p50_ms"], c[w + "_p99_ms"])
                for w in ("bus", "floor", "half", "bare"))))
    run.log("wrote", OUT)


if __name__ == "__main__":
    main()
