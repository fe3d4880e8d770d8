#!/usr/bin/env python3
"""Reads a kernel timeline written with DFLASH_CUDA_TRACE=FILE (src/backend/cuda/cuda_trace.cuh)
and prints where the time of one decode step goes, launch by launch, in place.

Usage: tools/trace_report.py FILE [--src DIR] [--gbps 4280] [--step -2,-1] [--list N] [--phases] [--cut N OUT]
(needs numpy: the GPU machine's Python has it; `tools/gpu_run.sh trace` runs it there)

Times: the global timer of each record (32 ns ticks on the H200); a CTA's start is its record
minus the cycles it counted since it began, at the fitted cycle rate. A launch is the records of one grid id within 2 ms (graph replays
reuse grid ids). A launch's "ready" is the first
CTA's return from griddepcontrol.wait (or its entry, without PDL): the previous kernel is done.
A launch's span is the time from its ready to the next launch's ready. For the fixed-point
linear the record at the end of its units gives its own time and the weight bytes, hence the
floor at --gbps.
"""
import argparse
import collections
import os
import re
import struct
import sys

import numpy as np

REC = struct.Struct("<QQQIHHHHI")


def kernel_names(path):
    """line number -> name of the __global__ kernel that contains it."""
    names, cur = {}, "?"
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines, 1):
        if "__global__" in line:
            m = re.search(r"\b(k_\w+)\s*\(", " ".join(lines[i - 1:i + 2]))
            cur = m.group(1) if m else "?"
        names[i] = cur
    return names


DT = [("grid", "<u8"), ("gtime", "<u8"), ("clk", "<u8"), ("dclk", "<u4"), ("site", "<u2"), ("kind", "<u2"),
      ("sm", "<u2"), ("cta", "<u2"), ("aux", "<u4")]


def load(path):
    with open(path, "rb") as f:
        head = f.read(16)
        if head[:8] != b"DFTRACE1":
            sys.exit("not a trace file: " + path)
        count, size = struct.unpack_from("<II", head, 8)
        if size != REC.size:
            sys.exit("record size %d, expected %d" % (size, REC.size))
        return np.fromfile(f, dtype=np.dtype(DT), count=count)


def cycle_rate(r):
    """cycles per ns: the median over SMs of the end-to-end slope of the cycle counter against
    the global timer (which ticks every 32 ns on the H200, so it places records directly)."""
    f_all = []
    for sm in np.unique(r["sm"]):
        m = r[r["sm"] == sm]
        i0, i1 = np.argmin(m["gtime"]), np.argmax(m["gtime"])
        dg = float(m["gtime"][i1]) - float(m["gtime"][i0])
        if dg > 100000:
            f_all.append((float(m["clk"][i1]) - float(m["clk"][i0])) / dg)
    if not f_all:
        sys.exit("too few records to fit the cycle rate")
    return float(np.median(f_all))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "backend", "cuda"))
    ap.add_argument("--gbps", type=float, default=4280.0)
    ap.add_argument("--step", default="-2", help="steps to report (split at k_embed), comma-separated; negative: from the end"
                    " (-1: the last, which ends at the trace's last launch)")
    ap.add_argument("--list", type=int, default=60, help="launches of the step listed one by one")
    ap.add_argument("--phases", action="store_true", help="per kernel, the phase records (kind 2) of its CTAs: "
                    "microseconds after the launch's ready: the mean over CTAs and launches, the mean of each launch's last CTA")
    ap.add_argument("--cut", nargs=2, metavar=("N", "OUT"), help="write the last N records as a trace file OUT and exit")
    a = ap.parse_args()
    names = {0: kernel_names(os.path.join(a.src, "cuda_kernels.cu")), 10000: kernel_names(os.path.join(a.src, "cuda_qlin.cu"))}

    def name(site):
        base = 10000 if site >= 10000 else 0
        return names[base].get(site - base, "?")

    recs = load(a.file)
    if a.cut:
        part = recs[-int(a.cut[0]):]
        with open(a.cut[1], "wb") as f:
            f.write(b"DFTRACE1" + struct.pack("<II", len(part), REC.size))
            part.tofile(f)
        return
    f = cycle_rate(recs)
    t = (recs["gtime"] - recs["gtime"].min()).astype(np.float64)
    start = t - recs["dclk"].astype(np.float64) / f
    # a launch: the records of one %gridid within 2 ms of each other (graph replays reuse a
    # node's grid id; they are a step apart)
    order = np.lexsort((t, recs["grid"]))
    g_o, t_o = recs["grid"][order], t[order]
    cut = np.nonzero((g_o[1:] != g_o[:-1]) | (t_o[1:] - t_o[:-1] > 2e6))[0] + 1
    launches = []
    for idx in np.split(order, cut):
        k0 = idx[recs["kind"][idx] == 0]
        k1 = idx[recs["kind"][idx] == 1]
        k2 = idx[recs["kind"][idx] == 2]
        if len(k0) == 0:
            continue
        ready = float(t[k0].min())
        phases = collections.defaultdict(list)  # kind 2 records: aux (the phase) -> times after ready
        for r in k2:
            phases[int(recs["aux"][r])].append(float(t[r]) - ready)
        launches.append({"name": name(int(recs["site"][k0[0]])), "ctas": len(k0), "start": float(start[k0].min()),
                         "ready": float(t[k0].min()), "ready_last": float(t[k0].max()),
                         "end_first": float(t[k1].min()) if len(k1) else None,
                         "end": float(t[k1].max()) if len(k1) else None,
                         "kb": int(recs["aux"][k1[0]]) if len(k1) else 0, "phases": phases})
    seq = sorted(launches, key=lambda L: L["ready"])
    starts = [i for i, L in enumerate(seq) if L["name"] == "k_embed"]
    if not starts:
        sys.exit("no k_embed launch: no step in the trace")
    bounds = list(zip(starts, starts[1:] + [len(seq) - 1]))
    for spec in a.step.split(","):
        k = int(spec)
        k = k if k >= 0 else len(bounds) + k
        if not 0 <= k < len(bounds):
            print("step %s: not in the trace (%d steps)" % (spec, len(bounds)))
            continue
        lo, hi = bounds[k]
        report(seq[lo:hi + 1], k, len(bounds), len(recs), len(seq), f, a)


def report(step, k, nsteps, nrecs, nseq, f, a):
    """Prints one step: launches step[0..-3], each timed to the next launch's ready (the step's
    last launch, its argmax, is left out: what follows it is host time)."""
    t0 = step[0]["ready"]
    step = step[:-1] if len(step) > 2 else step  # the last launch: the next step's start, or untimed
    total = step[-1]["ready"] - t0
    print("\n==== step %d of %d: %d launches, %.1f us (cycle rate %.3f GHz; %d records, %d launches in the trace)"
          % (k, nsteps, len(step) - 1, total / 1000, f, nrecs, nseq))
    agg = collections.OrderedDict()
    lin = {"n": 0, "span": 0.0, "own": 0.0, "floor": 0.0, "pre": 0.0, "tail": 0.0, "after": 0.0}
    rows = []
    for i in range(len(step) - 1):
        L, N = step[i], step[i + 1]
        span = N["ready"] - L["ready"]
        A = agg.setdefault(L["name"], [0, 0.0, 0])
        A[0] += 1
        A[1] += span
        A[2] += L["ctas"]
        extra = ""
        if L["end"] is not None:
            floor = L["kb"] * 1024 / (a.gbps * 1e9) * 1e9
            own = L["end"] - L["ready"]
            lin["n"] += 1
            lin["span"] += span
            lin["own"] += own
            lin["floor"] += floor
            lin["pre"] += max(0.0, L["ready"] - L["start"])
            lin["tail"] += L["end"] - L["end_first"]
            lin["after"] += N["ready"] - L["end"]
            extra = "own %6.1f floor %5.1f tail %5.1f next+%5.1f early %5.1f  %6.1f MB" % (
                own / 1e3, floor / 1e3, (L["end"] - L["end_first"]) / 1e3, (N["ready"] - L["end"]) / 1e3,
                (L["ready"] - L["start"]) / 1e3, L["kb"] / 1024)
        rows.append("%4d %8.1f %-22s %4d ctas span %6.1f  ready spread %5.1f  %s" % (
            i, (L["ready"] - t0) / 1e3, L["name"], L["ctas"], span / 1e3, (L["ready_last"] - L["ready"]) / 1e3, extra))
    print("by kernel (us per step):")
    for nm, (n, sp, ct) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print("  %-22s %4d launches %8.1f us  %5.1f%%  (%.1f us each, %.0f ctas)" % (nm, n, sp / 1e3, 100 * sp / max(total, 1),
                                                                                  sp / n / 1e3, ct / n))
    if lin["n"]:
        print("fixed-point linears: %d launches; span %.1f us, own (ready to last end) %.1f us, floor %.1f us (%.0f%% of own);"
              " last CTA minus first CTA end %.1f us; next kernel ready after the end %.1f us; CTAs started before ready %.1f us"
              % (lin["n"], lin["span"] / 1e3, lin["own"] / 1e3, lin["floor"] / 1e3, 100 * lin["floor"] / max(lin["own"], 1),
                 lin["tail"] / 1e3, lin["after"] / 1e3, lin["pre"] / 1e3))
    if a.phases:
        ph = collections.OrderedDict()
        for i in range(len(step) - 1):
            L, N = step[i], step[i + 1]
            for aux, ts in L["phases"].items():
                P = ph.setdefault((L["name"], aux), [[], [], []])
                P[0].extend(ts)
                P[1].append(max(ts))
                P[2].append(N["ready"] - L["ready"])
        print("phases (us after the launch's ready: mean over CTAs, mean of the last CTA, mean span to the next ready):")
        for (nm, aux), (ts, last, span) in sorted(ph.items()):
            print("  %-22s phase %2d: %6.2f  last %6.2f  span %6.2f  (%d launches)" % (
                nm, aux, sum(ts) / len(ts) / 1e3, sum(last) / len(last) / 1e3, sum(span) / len(span) / 1e3, len(last)))
    if a.list:
        print("first %d launches of the step (us from the step's start):" % a.list)
        for r in rows[:a.list]:
            print(r)

if __name__ == "__main__":
    main()
