"""Every benchmark explains itself (issue 19, section 4): --help gives what
it measures, its options and where results go; an unknown option is
refused; a run starts by saying what it does and how long it takes."""

import glob
import os
import re
import subprocess
import sys

import pytest

from loomtest.nginx import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchcli  # noqa: E402

BENCHES = sorted(glob.glob(os.path.join(ROOT, "bench", "*", "run.py")))


@pytest.mark.parametrize("script", BENCHES,
                         ids=[os.path.relpath(b, ROOT) for b in BENCHES])
def test_help_and_unknown_options(script):
    res = subprocess.run([sys.executable, script, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.startswith("usage: ")
    assert "bench/results/" in out, "--help does not say where results go"
    # every option the parser takes says what it does: argparse prints the
    # help after the option on its line, or on the next, indented
    lines = out.split("\noptions:\n")[1].split("\n")
    for i, line in enumerate(lines):
        if line.startswith("  -"):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            assert re.match(r"^  -\S.*?\s{2,}\S", line) or (
                nxt.startswith("      ") and not nxt.strip().startswith("-")
            ), "no help for " + line.strip()
    res = subprocess.run([sys.executable, script, "--no-such-option"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "unrecognized arguments: --no-such-option" in res.stderr


def test_announce_says_what_and_how_long(capsys):
    benchcli.announce("Measures the thing\nover two lines.\n\nDetails.",
                      610, "bench/results/x.json")
    out = capsys.readouterr().out.split("\n")
    assert out[0] == "Measures the thing over two lines."
    assert out[1].startswith("This run takes about 10 minutes")
    assert out[1].endswith("results: bench/results/x.json")
