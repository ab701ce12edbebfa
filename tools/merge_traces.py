"""Merge the per-rank traces of ``train.profile_steps`` into one Chrome/Perfetto trace, one
process lane per rank (named ``rank <r>``), for chrome://tracing or https://ui.perfetto.dev:

    python tools/merge_traces.py <run dir>/profile [--output <run dir>/profile/merged.json]

Every rank's events keep their own timestamps: the ranks of one machine share its clock; across
machines the lanes are as aligned as the nodes' clocks are. Prints each rank's count of
forward / backward / collective ranges (the annotations of ``glm5_train/profiling.py``), then
its time in collectives by purpose, the eight that took most (``parallel/comm_purpose.py``:
e.g. ``dp_grad_reduce_scatter``, ``pp_send``, ``ep_dispatch``; the time a call takes, waiting
for its peers included).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from parallel.comm_purpose import host_range, parse_range

RANK_FILE = re.compile(r"rank(\d+)\.json$")


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/merge_traces.py outputs/pp2_vpp2_trace/profile
  python tools/merge_traces.py outputs/pp2_vpp2_trace/profile --output /tmp/merged.json
"""


def rank_traces(directory: str) -> dict[int, dict]:
    """{rank: its trace} for every ``rank<N>.json`` in ``directory``."""
    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        match = RANK_FILE.search(path)
        if match:
            with open(path, encoding="utf-8") as handle:
                found[int(match.group(1))] = json.load(handle)
    if not found:
        raise SystemExit(f"no rank<N>.json traces in {directory}: run the job with "
                         "train.profile_steps=[first,last]")
    return found


def merge(traces: dict[int, dict]) -> dict:
    """One trace: rank r's events in process lane r (its threads kept apart within it)."""
    events = []
    for rank, trace in sorted(traces.items()):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                       "args": {"sort_index": rank}})
        for event in trace.get("traceEvents", []):
            if event.get("ph") == "M" and event.get("name") in ("process_name",
                                                                  "process_sort_index"):
                continue
            events.append({**event, "pid": rank})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def annotation_counts(trace: dict) -> dict[str, int]:
    counts = {"forward": 0, "backward": 0, "collective": 0}
    for event in trace.get("traceEvents", []):
        name = str(event.get("name", ""))
        if not host_range(event):
            continue
        if name.startswith("forward chunk"):
            counts["forward"] += 1
        elif name.startswith("backward chunk"):
            counts["backward"] += 1
        elif parse_range(name):
            counts["collective"] += 1
    return counts


def purpose_times(trace: dict) -> list[tuple[str, float, int]]:
    """(purpose, milliseconds, calls) of the trace's collective ranges, the most time first
    (ranges traced before purposes were named count under their function's name)."""
    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in trace.get("traceEvents", []):
        parsed = parse_range(str(event.get("name", ""))) if host_range(event) else None
        if parsed:
            entry = spent[parsed["purpose"] or parsed["function"]]
            entry[0] += event.get("dur", 0) / 1e3
            entry[1] += 1
    return sorted(((p, ms, int(n)) for p, (ms, n) in spent.items()), key=lambda t: -t[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="the run's profile/ directory")
    parser.add_argument("--output", help="default: <directory>/merged.json")
    args = parser.parse_args(argv)
    traces = rank_traces(args.directory)
    out = args.output or os.path.join(args.directory, "merged.json")
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(merge(traces), handle)
    for rank, trace in sorted(traces.items()):
        counts = annotation_counts(trace)
        print(f"rank {rank}: {counts['forward']} forward, {counts['backward']} backward, "
              f"{counts['collective']} collective ranges")
        by_purpose = ", ".join(f"{p} {ms:.1f} ms x{n}" for p, ms, n in purpose_times(trace)[:8])
        print(f"  collectives by purpose: {by_purpose or 'none'}")
    print(f"merged {len(traces)} ranks into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
