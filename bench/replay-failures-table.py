#!/usr/bin/env python3
"""Markdown of bench/run-replay-cluster-failures.sh's runs (its work directory): hit rate,
errors and answer checks per window of the trace, the steady run beside the run with
failures, and the index and event overhead per stored page.
    replay-failures-table.py WORK_DIR TRACE CAPACITY_PER_DAEMON
Exits 1 when a request got a wrong answer or the failure run did not serve every request.
"""
import json
import os
import sys

work, trace, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
load = lambda name: json.load(open(os.path.join(work, name)))
steady, steady_c = load("steady.json"), load("steady.cluster.json")
fail, fail_c = load("failures.json"), load("failures.cluster.json")
ps = fail["page_size"]
fields = fail_c["record_fields"]
rows = lambda c: [dict(zip(fields, r)) for r in c["records"]]
steady_rows, fail_rows = rows(steady_c), rows(fail_c)
hook = [line.split() for line in open(os.path.join(work, "hook.log"))]
at = {h[0]: h for h in hook}
kill_at, start_at, redis_at = int(at["kill"][2]), int(at["start"][2]), int(at["restart"][2])
n = fail["workload"]["requests"]
after_redis = min(n, redis_at + (n - redis_at) // 2)
windows = [("before the kill", 0, kill_at),
           ("m0 killed (SIGKILL), until it restarts", kill_at, start_at),
           ("m0 back (new incarnation)", start_at, redis_at),
           ("Redis restarted empty (first half)", redis_at, after_redis),
           ("after (second half)", after_redis, n)]


def window(rs, lo, hi):
    sel = [r for r in rs if lo <= r["index"] < hi]
    prompt = sum(r["input_length"] for r in sel)
    hit = sum(r["matched_tokens"] // ps * 512 for r in sel)
    return {"requests": len(sel), "hit": hit / prompt if prompt else 0.0,
            "unavailable": sum(r["unavailable"] for r in sel),
            "failovers": sum(1 for r in sel if r["unavailable"] > 0),
            "index_errors": sum(r["index_error"] for r in sel),
            "checked": sum(r["checked"] for r in sel), "wrong": sum(r["wrong"] for r in sel),
            "members": sorted({r["member"] for r in sel}),
            "seconds": (max(r["seconds"] for r in sel) - min(r["seconds"] for r in sel))
            if sel else 0.0}


pct = lambda x: f"{100 * x:.2f}%"
w = fail["workload"]
print(f"Trace: `{os.path.basename(trace)}`, {n} requests, {w['prompt_tokens']:,} prompt tokens. "
      f"4 daemons of {cap:,} pages each (lease TTL 3 s, load interval 250 ms), index routing "
      f"with peer pulls and replication, every sequence committed on close, every request's "
      f"attention checked against a float64 reference (`--verify-every 1`).\n")
print("| window (requests) | requests | hit rate, steady run | hit rate, failure run | "
      "UNAVAILABLE answers | requests served again elsewhere | index lookups failed | "
      "checked | wrong | failure run's seconds |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, lo, hi in windows:
    s, f = window(steady_rows, lo, hi), window(fail_rows, lo, hi)
    print(f"| {name} [{lo}, {hi}) | {f['requests']} | {pct(s['hit'])} | {pct(f['hit'])} "
          f"| {f['unavailable']} | {f['failovers']} | {f['index_errors']} | {f['checked']} "
          f"| {f['wrong']} | {f['seconds']:.1f} |")
s_all, f_all = window(steady_rows, 0, n), window(fail_rows, 0, n)
print(f"| whole trace | {f_all['requests']} | {pct(s_all['hit'])} | {pct(f_all['hit'])} "
      f"| {f_all['unavailable']} | {f_all['failovers']} | {f_all['index_errors']} "
      f"| {f_all['checked']} | {f_all['wrong']} | {fail['seconds']:.1f} |")
served = fail["requests"]
print(f"\nFailure run: {served} of {n} requests served (a request is an error only if no member "
      f"could serve it: {n - served}); {fail_c['failovers']} requests re-served on another "
      f"member after an UNAVAILABLE, {fail_c['rejoins']} rejoin(s) of a restarted member; "
      f"pulls {fail_c['pulls']} ({fail_c['pull_errors']} failed: the member prefilled instead), "
      f"replications {fail_c['replications']}; index lookups that failed (routed by rendezvous): "
      f"{fail_c['index_errors']}; index entries refused by the fence: {fail_c['index_rejected']}.")
print(f"Answers checked: {steady_c['checked']} in the steady run, {fail_c['checked']} in the "
      f"failure run; wrong: {steady_c['wrong']} and {fail_c['wrong']}.")
if fail_c["wrong_details"] or steady_c["wrong_details"]:
    print("Wrong answers: " + "; ".join(steady_c["wrong_details"] + fail_c["wrong_details"]))
kill_t = float(at["kill"][3])
if "lease_gone" in at:
    print(f"m0's key left etcd {float(at['lease_gone'][1]) - kill_t:.2f} s after the kill hook "
          f"(the SIGKILL lands 0.02 s after it; bound TTL + TTL/3 = 4 s).")
elif "replaced" in at:
    print(f"m0's restart replaced its key {float(at['replaced'][1]) - kill_t:.2f} s after the "
          f"kill hook, before the old lease ended.")
if "m0_ready" in at:
    print(f"m0 was ready again {float(at['m0_ready'][1]) - float(at['start'][3]):.2f} s after "
          f"its start (the replay went on meanwhile).")
if "redis_ready" in at and "redis_kill" in at:
    print(f"Redis was down at most {float(at['redis_ready'][1]) - float(at['redis_kill'][1]):.2f} "
          f"s (from the kill to an empty Redis ready; the replay went on meanwhile).")

# Overhead per stored page (steady run).
try:
    used = int(open(os.path.join(work, "steady.redis_bytes")).read().strip())
    blocks = int(open(os.path.join(work, "steady.redis_blocks")).read().strip())
    print(f"\nIndex: {used:,} bytes of Redis memory for {blocks:,} `blk:` keys after the steady "
          f"run: {used / max(blocks, 1):.0f} bytes per indexed page.")
except (OSError, ValueError):
    pass
ev = load("events.json")
if ev["blocks_stored"]:
    print(f"Events (ZeroMQ, vLLM's KVEventBatch, a subscriber on all 4 publishers for the steady "
          f"run): {ev['messages']:,} messages, {ev['blocks_stored']:,} blocks stored, "
          f"{ev['blocks_removed']:,} removed; {ev['zmtp_bytes']:,} bytes on the wire (ZMTP 3 "
          f"frames: topic, sequence number, msgpack batch; TCP/IP headers not counted) = "
          f"**{ev['zmtp_bytes'] / ev['blocks_stored']:.0f} bytes per stored page**, removals "
          f"included; batches holding only BlockStored: "
          f"{ev['stored_only_zmtp_bytes'] / max(ev['stored_only_blocks'], 1):.0f} bytes per "
          f"page. Undecodable: {ev['undecodable']}.")

bad = []
if fail_c["wrong"] or steady_c["wrong"]:
    bad.append(f"wrong answers: {steady_c['wrong']} steady, {fail_c['wrong']} with failures")
if served != n or steady["requests"] != n:
    bad.append(f"requests served: {steady['requests']} steady, {served} with failures, of {n}")
if bad:
    print("replay-failures-table: " + "; ".join(bad), file=sys.stderr)
    sys.exit(1)
