#!/usr/bin/env python3
"""Instructions per request from envoy/callgrind.sh's profiles, split by where they ran.

Envoy's binary is stripped, so functions are addresses. The report finds its way with what
every profile shows regardless:
- wasm code compiled by V8 sits outside every mapped file, at high addresses; Envoy's code
  in its binary; tcmalloc in a section valgrind does not attribute to the binary (low
  addresses without a file), counted here as Envoy's allocator;
- a VM entry is a call from Envoy's code into wasm code (a callback, or Envoy asking the
  module for memory to copy a host call's result into);
- a host call is a call from wasm code into Envoy: they all pass one function, the wrapper;
- the probe (filter/examples/hostcall_probe.rs) makes each kind of host call 2^k times per
  request, so the functions below the wrapper are named by the bits of their call count.
"""
import argparse
import collections
import os
import re
import sys

PROBE_KINDS = [  # bit k: the kind hostcall_probe.rs calls 2^k times per request (its constants)
    "send_local_response", "get_shared_data", "get_property", "get_header_map_value",
    "get_header_map_pairs", "get_buffer_bytes", "set_buffer_bytes", "set_shared_data",
    "set_property", "replace_header_map_value", "record_metric", "increment_metric",
    "get_current_time",
]
JIT_FLOOR = 1 << 32


def parse(path):
    """Self cost per function and (caller, callee) -> [calls, inclusive] from one dump."""
    names = {"ob": {}, "fn": {}}
    self_cost = collections.Counter()
    edges = collections.defaultdict(lambda: [0, 0])
    ob = cur = cob = cfn = None
    calls = None

    def name(kind, token):
        m = re.match(r"\((\d+)\)(?: (.*))?$", token)
        if not m:
            return token
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), m.group(1))

    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("ob="):
                ob = name("ob", line[3:])
            elif line.startswith("fn="):
                cur = (ob, name("fn", line[3:]))
            elif line.startswith("cob="):
                cob = name("ob", line[4:])
            elif line.startswith("cfn="):
                cfn = (cob if cob is not None else ob, name("fn", line[4:]))
                cob = None
            elif line.startswith("calls="):
                calls = int(line[6:].split()[0])
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if len(parts) < 2:
                    continue
                cost = int(parts[1])
                if calls is not None:
                    e = edges[(cur, cfn)]
                    e[0] += calls
                    e[1] += cost
                    calls = None
                else:
                    self_cost[cur] += cost
    return self_cost, edges


def address(fn):
    try:
        return int(fn[1].split("'")[0].split(":")[-1], 16)
    except ValueError:
        return None


def kind(fn):
    ob = fn[0] or ""
    if ob.endswith("/envoy"):
        return "envoy"
    if ob == "???":
        a = address(fn)
        if a is None:
            return "other"
        return "wasm" if a >= JIT_FLOOR else "allocator"
    if "libc" in ob:
        return "libc"
    return "other"


class Profile:
    def __init__(self, path, requests):
        self.n = requests
        self.self_cost, self.edges = parse(path)
        self.total = sum(self.self_cost.values())
        self.callees = collections.defaultdict(dict)
        self.callers = collections.defaultdict(dict)
        self.calls = collections.Counter()
        for (a, b), (c, i) in self.edges.items():
            self.callees[a][b] = (c, i)
            self.callers[b][a] = (c, i)
            self.calls[b[1]] += c
        into_envoy = collections.Counter()
        for (a, b), (_, i) in self.edges.items():
            if kind(a) == "wasm" and kind(b) == "envoy":
                into_envoy[b] += i
        self.wrapper = into_envoy.most_common(1)[0][0] if into_envoy else None

    def per(self, x):
        return x / self.n

    def by_kind(self):
        out = collections.Counter()
        for fn, c in self.self_cost.items():
            out[kind(fn)] += c
        return out

    def vm_entries(self):
        """(calls, inclusive) of Envoy -> wasm calls, by Envoy's calling function."""
        out = collections.defaultdict(lambda: [0, 0])
        for (a, b), (c, i) in self.edges.items():
            if kind(a) != "wasm" and kind(b) == "wasm":
                out[a[1]][0] += c
                out[a[1]][1] += i
        return out

    def host_calls(self):
        """(calls, inclusive) of the wrapper: every wasm -> Envoy call."""
        c = i = 0
        for a, (cc, ii) in self.callers.get(self.wrapper, {}).items():
            if kind(a) == "wasm":
                c += cc
                i += ii
        return c, i


def name_host_functions(probe):
    """Address -> kinds for Envoy's host functions, from the probe's profile. Below the
    wrapper each kind of host call has a function whose count per request is that kind's
    bit; Envoy reaches some through a dispatcher (a function whose count is the sum of
    several kinds and whose callees split it), whose callees are then taken instead."""
    total = probe.calls[probe.wrapper[1]]

    def bits(fn):
        per = probe.calls[fn[1]] / probe.n
        k = round(per)
        if abs(per - k) > 0.02 or not 0 < k < (1 << len(PROBE_KINDS)) - 1:
            return None
        return frozenset(b for b in range(len(PROBE_KINDS)) if k >> b & 1)

    named = {}

    def visit(fn, depth):
        own = bits(fn)
        if own is None:
            return
        kids = [c for c in probe.callees.get(fn, {}) if kind(c) == "envoy" and bits(c)]
        split = [c for c in kids if bits(c) < own]
        same = [c for c in kids if bits(c) == own]
        if depth < 4 and len(split) >= 2:
            for c in split:
                visit(c, depth + 1)
        elif depth < 4 and len(own) > 1 and len(same) == 1:
            visit(same[0], depth + 1)
        else:
            named[fn[1]] = [PROBE_KINDS[b] for b in sorted(own)]

    for fn in probe.callees.get(probe.wrapper, {}):
        if kind(fn) == "envoy" and probe.calls[fn[1]] < total:
            visit(fn, 1)
    return named


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="target/callgrind")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--suffix", default=".out.1",
                    help="profile file suffix: .out.1-NN for thread NN of a --separate-threads run")
    args = ap.parse_args()

    def load(name):
        path = os.path.join(args.dir, name + args.suffix)
        return Profile(path, args.requests) if os.path.exists(path) else None

    # The probe names host functions by call counts, whatever the body size: a sitting
    # without its own probe run borrows the default one.
    probe_path = next((p for p in (os.path.join(args.dir, "probe.out.1"),
                                   "target/callgrind/probe.out.1") if os.path.exists(p)), None)
    probe = Profile(probe_path, args.requests) if probe_path else None
    # envoy/callgrind.sh compare (base-N and router-N) or noretry-N and router-N, in the
    # order they ran.
    rounds = sorted(
        (int(m.group(2)), m.group(1) == "router", m.group(0))
        for f in os.listdir(args.dir)
        if (m := re.match(r"(base|noretry|router)-(\d+)", f)) and f == m.group(0) + args.suffix)
    names_run = ["floor", "base", "router"] + [n for _, _, n in rounds]
    targets = [(n, p) for n in names_run if (p := load(n))]
    if not targets:
        sys.exit(f"no profiles in {args.dir} (envoy/callgrind.sh writes them)")
    names = name_host_functions(probe) if probe else {}
    k = 1000.0
    cols = "".join(f"{n:>22}" for n, _ in targets)
    print(f"thousands of instructions per request (callgrind), {args.requests} requests each\n")
    print(f"{'':34}{cols}")

    def row(label, values):
        print(f"{label:34}" + "".join(f"{v:>22}" for v in values))

    row("total", [f"{p.per(p.total) / k:.1f}" for _, p in targets])
    for part in ("envoy", "allocator", "wasm", "libc", "other"):
        row(f"  self: {part}", [f"{p.per(p.by_kind()[part]) / k:.1f}" for _, p in targets])

    # callgrind names a function entered again below itself `name'2`: Envoy's VM-entry
    # function called while a callback runs is the nested entry that asks the module for
    # memory to copy a host call's result into.
    def entries(p, nested):
        c = i = 0
        for a, (cc, ii) in p.vm_entries().items():
            if ("'" in a) == nested:
                c, i = c + cc, i + ii
        return c, i

    def inside(p):
        return sum(i for a, (_, i) in p.vm_entries().items() if "'" not in a)

    row("Envoy outside the VM", [f"{p.per(p.total - inside(p)) / k:.1f}" for _, p in targets])
    row("inside VM callbacks (incl.)", [f"{p.per(inside(p)) / k:.1f}" for _, p in targets])
    row("  callbacks (VM entries)", [f"{p.per(entries(p, False)[0]):.1f} x" for _, p in targets])
    row("  result copies (nested entries)",
        [f"{p.per(entries(p, True)[0]):.1f} x" for _, p in targets])
    row("  wasm code (self)", [f"{p.per(p.by_kind()['wasm']) / k:.1f}" for _, p in targets])
    row("  host calls (calls, incl.)",
        [f"{p.per(p.host_calls()[0]):.1f} x, {p.per(p.host_calls()[1]) / k:.1f}"
         for _, p in targets])
    if names:
        print("\nhost functions named by the probe (calls per request, thousands of instructions "
              "per request, instructions per call):")
        for addr, kinds in sorted(names.items(), key=lambda x: PROBE_KINDS.index(x[1][0])):
            vals = []
            for _, p in targets:
                c = p.calls.get(addr, 0)
                incl = sum(i for (a, b), (cc, i) in p.edges.items() if b[1] == addr
                           and a[1] not in names)
                vals.append(f"{p.per(c):.1f} x {p.per(incl) / k:.1f} ({incl / max(c, 1):.0f})"
                            if c else "-")
            row("  " + " + ".join(kinds), vals)
        over, other = [], []
        for _, p in targets:
            w = p.wrapper
            calls = p.calls[w[1]]
            per_call = sum(i for b, (c, i) in p.callees.get(w, {}).items()
                           if kind(b) == "allocator" or c == calls)
            overhead = p.self_cost[w] + per_call
            named_incl = sum(i for (a, b), (_, i) in p.edges.items()
                             if b[1] in names and a[1] not in names)
            named_calls = sum(p.calls.get(a, 0) for a in names)
            c, i = p.host_calls()
            over.append(f"{p.per(overhead) / k:.1f} ({overhead / max(calls, 1):.0f})")
            other.append(f"{p.per(c - named_calls):.1f} x {p.per(i - named_incl - overhead) / k:.1f}")
        row("  every call's passage (per call)", over)
        row("  unnamed (http_call, ...)", other)
    print("\nVM entries by Envoy's calling function (calls per request, thousands of "
          "instructions per request):")
    callers = set()
    for _, p in targets:
        callers |= set(p.vm_entries())
    ranked = sorted(callers, key=lambda a: -max(p.vm_entries().get(a, [0, 0])[1] for _, p in targets))
    for a in ranked[:10]:
        vals = []
        for _, p in targets:
            c, i = p.vm_entries().get(a, [0, 0])
            vals.append(f"{p.per(c):.2f} x {p.per(i) / k:.1f}" if c else "-")
        row("  " + a.split(":")[-1], vals)


if __name__ == "__main__":
    main()
