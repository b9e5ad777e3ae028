r"""Where a traced step's device time goes: a summary of a JAX Perfetto trace.

Reads the ``perfetto_trace.json.gz`` that ``jax.profiler.trace(...,
create_perfetto_trace=True)`` writes (Chrome trace events) and sums, per
device process (``/device:GPU:0`` and the like; the host's own process when
there is no device one), the duration of its complete events by kind:

* ``matmul``: cuBLAS / cuDNN / CUTLASS GEMM kernels and XLA ``dot`` or
  ``gemm`` custom calls;
* ``copy``: memcpy / memset;
* ``other``: everything else (XLA's elementwise and reduction fusions, RNG,
  optimizer updates).

It also reports the union of busy intervals against the traced span (the
device's idle share: host work, launch gaps) and the costliest kernel names.

    python benchmarks/trace_summary.py TRACE_DIR_OR_FILE [--top 25]

The kind rules are name patterns, so a kernel whose name says nothing is
counted as ``other``; the top-name list is printed to check them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

MATMUL = re.compile(r"gemm|cublas|cudnn|cutlass|xmma|nvjet|\bdot\b|matmul", re.I)
COPY = re.compile(r"memcpy|memset", re.I)


def find_trace(path: str) -> str:
    """The newest perfetto trace under ``path`` (or ``path`` itself)."""
    if os.path.isfile(path):
        return path
    found = glob.glob(
        os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True
    )
    if not found:
        raise FileNotFoundError(
            f"No perfetto_trace.json.gz under {path!r}; trace with "
            "jax.profiler.trace(dir, create_perfetto_trace=True)."
        )
    return max(found, key=os.path.getmtime)


def kind_of(name: str) -> str:
    if COPY.search(name):
        return "copy"
    if MATMUL.search(name):
        return "matmul"
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(trace_path: str, top: int = 25) -> dict:
    with gzip.open(trace_path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = [p for p, n in names.items() if "device" in n.lower()]
    pids = device or list(names)
    out = {"trace": trace_path, "processes": {}}
    for pid in pids:
        spans = [
            e
            for e in events
            if e.get("pid") == pid and e.get("ph") == "X" and "dur" in e
        ]
        if not spans:
            continue
        by_kind = collections.Counter()
        by_name = collections.Counter()
        count = collections.Counter()
        arg_keys = collections.Counter()
        for e in spans:
            name = e.get("name", "")
            by_kind[kind_of(name)] += e["dur"]
            by_name[name] += e["dur"]
            count[name] += 1
            arg_keys.update((e.get("args") or {}).keys())
        start = min(e["ts"] for e in spans)
        end = max(e["ts"] + e["dur"] for e in spans)
        busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in spans])
        total = sum(by_kind.values())
        out["processes"][names.get(pid, str(pid))] = {
            "events": len(spans),
            "span_ms": round((end - start) / 1e3, 3),
            "busy_ms": round(busy / 1e3, 3),
            "busy_share": round(busy / max(end - start, 1e-9), 3),
            "sum_ms": round(total / 1e3, 3),
            "by_kind_ms": {k: round(v / 1e3, 3) for k, v in by_kind.most_common()},
            "by_kind_share": {
                k: round(v / max(total, 1e-9), 3) for k, v in by_kind.most_common()
            },
            "top": [
                {"name": n[:160], "ms": round(v / 1e3, 3), "count": count[n]}
                for n, v in by_name.most_common(top)
            ],
            "arg_keys": dict(arg_keys.most_common(12)),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="a trace directory or perfetto_trace.json.gz")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(json.dumps(summarize(find_trace(args.path), args.top), indent=1))


if __name__ == "__main__":
    main()
