#!/usr/bin/env python3
"""Markdown table of bench/run-replay-cluster.sh's runs (its work directory): the hit rate of
each routing mode over 4 daemons beside one daemon with 4x the capacity, the goals of issue
32, lookup latency, pulls, balance and the index's Redis footprint per stored page.
    replay-cluster-table.py [--check] WORK_DIR TRACE CAPACITY_PER_DAEMON MODE...
--check (the CI-sized run): exits 1 unless every run served every request, every answer
checked (kvcd-replay --verify-every) was right, and every routing other than random beats
random routing's hit rate.
"""
import json
import os
import sys

argv = sys.argv[1:]
check = bool(argv) and argv[0] == "--check"
if check:
    argv = argv[1:]
work, trace, cap, modes = argv[0], argv[1], int(argv[2]), argv[3:]
load = lambda name: json.load(open(os.path.join(work, name)))
big = load("big.json")
runs = {m: (load(f"{m}.json"), load(f"{m}.cluster.json")) for m in modes}
pct = lambda x: f"{100 * x:.2f}%"
big_hit = big["daemon"]["hit_rate"]
random_hit = runs["random"][0]["daemon"]["hit_rate"] if "random" in runs else None
w = big["workload"]
print(f"Trace: `{os.path.basename(trace)}`, {big['requests']} requests, "
      f"{w['prompt_tokens']:,} prompt tokens, {w['full_blocks']:,} full blocks "
      f"({w['distinct_blocks']:,} distinct). 4 daemons of {cap:,} pages each beside one of "
      f"{4 * cap:,} pages; every sequence committed on close.\n")
print("| routing | hit rate | vs one daemon with 4x capacity | vs random | max/mean pages held "
      "| requests per member | pulls (tokens) | replications | errors | requests/s |")
print("|---|---|---|---|---|---|---|---|---|---|")
vs_random = lambda hit: f"{hit / random_hit:.2f}x" if random_hit else "-"
print(f"| one daemon, {4 * cap:,} pages | {pct(big_hit)} | 100% | {vs_random(big_hit)} | - | - "
      f"| - | - | 0 | {big['requests_per_second']:.1f} |")
for m, (r, c) in runs.items():
    hit = r["daemon"]["hit_rate"]
    per = " / ".join(str(x["requests"]) for x in c["members"])
    errors = c["pull_errors"] + c["index_errors"] + (r["workload"]["requests"] - r["requests"])
    print(f"| {m} | {pct(hit)} | {100 * hit / big_hit:.1f}% | {vs_random(hit)} "
          f"| {c['pages_max_over_mean']:.3f} | {per} | {c['pulls']} ({c['pulled_tokens']:,}) "
          f"| {c['replications']} | {errors} | {r['requests_per_second']:.1f} |")
if "index" in runs:
    r, c = runs["index"]
    print(f"\nIndex routing: lookup added per request (hashing the prompt's pages, one pipelined "
          f"HGETALL per page, the members' loads) p50 {c['lookup_p50_ms']:.3f} ms, p99 "
          f"{c['lookup_p99_ms']:.3f} ms over {c['lookups']} lookups; PullPrefix p50 "
          f"{c['pull_p50_ms']:.2f} ms, p99 {c['pull_p99_ms']:.2f} ms; index entries refused by "
          f"the fence: {c['index_rejected']}.")
    try:
        used = int(open(os.path.join(work, "index.redis_bytes")).read().strip())
        blocks = int(open(os.path.join(work, "index.redis_blocks")).read().strip())
        held = sum(x["pages_held"] for x in c["members"])
        print(f"Redis after the index run: {used:,} bytes used for {blocks:,} `blk:` keys "
              f"({held:,} pages held by the members at the end): "
              f"{used / max(blocks, 1):.0f} bytes per indexed page.")
        cmds = open(os.path.join(work, "index.redis_cmds")).read().split()
        if cmds:
            print("Redis commands during the run: " + ", ".join(
                x.split(":")[0].replace("cmdstat_", "").upper() + " "
                + x.split("calls=")[1].split(",")[0] for x in cmds) + ".")
    except (OSError, ValueError, IndexError):
        pass

if check:
    failed = [f"{m}: {r['requests']} of {r['workload']['requests']} requests served"
              for m, (r, _) in runs.items() if r["requests"] != r["workload"]["requests"]]
    failed += [f"{m}: {r['wrong_requests']} of {r['checked_requests']} answers checked were wrong"
               for m, (r, _) in runs.items() if r.get("wrong_requests", 0) != 0]
    failed += [f"{m}: no answer was checked" for m, (r, _) in runs.items()
               if r.get("checked_requests", 0) == 0]
    if big.get("wrong_requests", 0) != 0 or big.get("checked_requests", 0) == 0:
        failed.append(f"one daemon: {big.get('wrong_requests')} of "
                      f"{big.get('checked_requests')} answers checked were wrong")
    for m, (r, _) in runs.items():  # every routing that keys on the prompt beats random
        if m != "random" and random_hit is not None and not r["daemon"]["hit_rate"] > random_hit:
            failed.append(f"{m} routing's hit rate {r['daemon']['hit_rate']:.4f} does not beat "
                          f"random routing's {random_hit:.4f}")
    if failed:
        print("replay-cluster-table: check failed: " + "; ".join(failed), file=sys.stderr)
        sys.exit(1)
