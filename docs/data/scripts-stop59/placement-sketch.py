#!/usr/bin/env python3
"""stop 59 (issue 22): sketches of online placement estimates, in Python before touching the engine.

Each sketch replays a trace the way `strata-tools replay` does (a window's experts hit when the cache held them
before it; caches start with experts 0.. of each layer; one warm cache) and, after each token, keeps per layer the
`slots` experts of (cache ∪ the token's experts) ranked by an online estimate of use by the next token:
- glob: the long-run share of the layer's routing entries; req: the request's own entries blended with the long-run
  share (a prior worth 32 entries);
- demand: the token's experts ranked first (demand admission); est: a reuse bonus instead, the observed one-token
  reuse rate r: chance per rank r/k for the token's experts + (1 - r) * share, ranked by 1 - (1 - chance)^k.

Usage: placement-sketch.py synth SOURCE:STICK,... SLOTS  (the traces of tools/routing-synth, seed 1, 40 requests)
       placement-sketch.py trace FILE.jsonl SLOTS        (a --dump-routing trace: its decode windows)
"""
import json
import random
import sys
from collections import defaultdict
from importlib.machinery import SourceFileLoader
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SYNTH = SourceFileLoader("routing_synth", str(REPO / "tools" / "routing-synth")).load_module()
MODES = ("glob-demand", "glob-est", "req-demand", "req-est")


def sketch(reqs, n_layer, n_expert, k, slots, mode, prior=32.0):
    """Hit rate of `mode` over `reqs` ([per request: [per token: [per layer: experts]]]), one warm cache."""
    hits = total = 0
    for l in range(n_layer):
        g, gsum = [0.0] * n_expert, 0.0
        cache = set(range(min(slots, n_expert)))
        reuse_n = reuse_d = 0
        prev = None
        for toks in reqs:
            r, rsum = [0.0] * n_expert, 0.0
            for tok in toks:
                w = tok[l]
                total += len(w)
                hits += sum(e in cache for e in w)
                if prev is not None:
                    reuse_n += sum(e in prev for e in w)
                    reuse_d += len(w)
                prev = set(w)
                for e in w:
                    g[e] += 1
                    r[e] += 1
                gsum += len(w)
                rsum += len(w)
                rate = reuse_n / reuse_d if reuse_d else 0.0

                def share(e):
                    pg = (g[e] + 1e-9) / (gsum + 1e-9 * n_expert)
                    return (r[e] + prior * pg) / (rsum + prior) if mode.startswith("req") else pg

                def rank(e):
                    if mode.endswith("demand"):
                        return (e in prev, share(e))
                    c = (rate / k if e in prev else 0.0) + (1 - rate) * share(e)
                    return (False, 1 - (1 - min(c, 1.0)) ** k)

                cache = set(sorted(cache | prev, key=lambda e: (rank(e), -e), reverse=True)[:slots])
    return hits / max(total, 1)


def main():
    kind, what, slots = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    if kind == "synth":
        sources = SYNTH.sources(REPO / "tools" / "data" / "routing")
        for spec in what.split(","):
            name, stick = spec.split(":")
            top_k, doms = sources[name]
            used = []
            SYNTH.trace(random.Random(f"1-{name}-{float(stick)}"), top_k, doms, 40, float(stick), used)
            reqs = [toks for _, toks in used]
            n_layer, n_expert = len(reqs[0][0]), len(next(iter(doms.values()))[0])
            for s in slots:
                res = " ".join(f"{m} {sketch(reqs, n_layer, n_expert, top_k, s, m):.3f}" for m in MODES)
                print(f"{name}-stick{stick} slots {s}: {res}", flush=True)
    else:
        recs = defaultdict(dict)
        for line in open(what):
            d = json.loads(line)
            if d["phase"] == "decode":
                recs[(str(d["seq"]), d["pos"])][d["layer"]] = d["experts"]
        n_layer = 1 + max(l for v in recs.values() for l in v)
        n_expert = 1 + max(e for v in recs.values() for x in v.values() for e in x)
        top_k = max(len(x) for v in recs.values() for x in v.values())
        by_seq = defaultdict(list)
        for (seq, pos) in sorted(recs, key=lambda sp: ((0, int(sp[0])) if sp[0].isdigit() else (1, sp[0]), sp[1])):
            by_seq[seq].append([recs[(seq, pos)].get(l, []) for l in range(n_layer)])
        reqs = list(by_seq.values())
        for s in slots:
            res = " ".join(f"{m} {sketch(reqs, n_layer, n_expert, top_k, s, m):.3f}" for m in MODES)
            print(f"{Path(what).stem} slots {s}: {res}", flush=True)


if __name__ == "__main__":
    main()
