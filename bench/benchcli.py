"""The benchmarks' command line, one convention for all: `--help` prints
the script's docstring (what it measures, its environment knobs) and its
options; a run starts by saying what it does, roughly how long it will take
with the settings given, and where the results go."""

import argparse


def parser(doc):
    return argparse.ArgumentParser(
        description=doc.strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter)


def announce(doc, seconds, results):
    what = " ".join(doc.strip().split("\n\n")[0].split())
    print(what)
    print("This run takes about %d minutes with these settings (--help for "
          "the options); results: %s" % (max(1, round(seconds / 60)),
                                         results), flush=True)
