#!/usr/bin/env python3
"""Failures of a kvcd cluster, in the topology of scripts/cluster-topology.sh (run by
scripts/test-cluster.sh; docs/cluster.md "When a part fails").

A bounded multi-turn workload (conversations over shared system prompts) runs through
kvcd.cluster's ClusterClient on the topology's daemons, etcd and Redis while, in turn:

  steady        nothing fails (the reference hit rate)
  member-kill   a member is SIGKILLed while sessions are open on it
  member-cut    a member's link goes down while sessions are open on it, then comes back
  redis-restart Redis restarts empty
  etcd-restart  etcd restarts empty (its data directory removed)

Every K/V row is a pure function of the token prefix that ends at it, so the expected
attention of any session is known: every session is checked (attention of a random query on
each layer against a float64 reference) after it opens, after it appends, and after every
failover. Per phase: requests, errors, wrong results, hit rate, failovers; and what was
measured: the lease's end after the kill/cut (etcd deletes the key), the index forgetting
the member (its held: set purged, no blk: field left), re-registration after the link is
restored and after etcd restarts, Redis republication after its restart. Exit status 1 when
a result is wrong, a bound is broken, or a phase that must not fail had errors. Prints a
JSON report (--json FILE also writes it).
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import redis as redis_py

import kvcd
from kvcd.cluster import BlockIndex, ClusterClient, EtcdMembership, RoutingConfig, default_prefix

MODEL = "cluster-failures"
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, PAGE = 2, 2, 4, 32, 16
# Client-side gRPC settings: a connection to a member that stops answering (killed, or cut
# off) is found dead within ~2 s (keepalive), and reconnecting to it gives up within 1 s,
# so that calls fail UNAVAILABLE and the session fails over instead of waiting out deadlines.
CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 1000),
                   ("grpc.min_reconnect_backoff_ms", 1000),
                   ("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def ctl(*args):
    out = subprocess.run([os.environ["KVCD_TOPO_CTL"], "ctl", *args], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def wait_until(predicate, timeout, poll=0.05):
    """Polls predicate (bounded): True once it holds, False after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


# --- K/V as a function of the token prefix ------------------------------------------------

def _mix(x):
    """splitmix64 on a uint64 array."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & MASK
        return x ^ (x >> np.uint64(31))


class History:
    """Tokens and their K/V [layers, n, kv_heads, head_dim]. Row p depends on tokens[0..p]
    only (a hash chain), so two sessions that share a prefix share its K/V, as a model's
    would. Values are multiples of 1/128 in [-1, 1): exact in BF16."""

    def __init__(self, tokens=(), chain=None, k=None, v=None):
        self.tokens = list(tokens)
        self.chain = chain if chain is not None else np.zeros(0, np.uint64)
        shape = (LAYERS, 0, KV_HEADS, HEAD_DIM)
        self.k = k if k is not None else np.zeros(shape, np.float32)
        self.v = v if v is not None else np.zeros(shape, np.float32)

    @staticmethod
    def rows(chain):
        n = len(chain)
        e = np.arange(KV_HEADS * HEAD_DIM, dtype=np.uint64)
        out = []
        for kind in (1, 2):
            per_layer = []
            for layer in range(LAYERS):
                seed = _mix(chain ^ np.uint64((layer << 8) | kind))
                with np.errstate(over="ignore"):
                    x = _mix((seed[:, None] + e[None, :] * np.uint64(0x632BE59BD9B4E019)) & MASK)
                vals = ((x >> np.uint64(56)).astype(np.int64) - 128).astype(np.float32) / 128.0
                per_layer.append(vals.reshape(n, KV_HEADS, HEAD_DIM))
            out.append(np.stack(per_layer))
        return out

    def extend(self, tokens):
        """A new History with `tokens` appended; returns (history, k_new, v_new)."""
        h = int(self.chain[-1]) if len(self.chain) else 0x5EED
        chain = np.empty(len(tokens), np.uint64)
        for i, t in enumerate(tokens):
            h = int(_mix(np.array([h ^ (int(t) + 1)], np.uint64))[0])
            chain[i] = h
        k_new, v_new = self.rows(chain)
        nh = History(self.tokens + list(tokens), np.concatenate([self.chain, chain]),
                     np.concatenate([self.k, k_new], axis=1),
                     np.concatenate([self.v, v_new], axis=1))
        return nh, k_new, v_new


def reference_attention(q, k, v):
    """float64 attention: q [Hq, D], k/v [n, Hkv, D] -> o [Hq, D], lse [Hq]."""
    g = Q_HEADS // KV_HEADS
    kk = np.repeat(k.astype(np.float64), g, axis=1)  # [n, Hq, D]
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("nhd,hd->hn", kk, q.astype(np.float64)) / np.sqrt(HEAD_DIM)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    o = np.einsum("hn,nhd->hd", p, vv) / p.sum(axis=1, keepdims=True)
    return o, (m[:, 0] + np.log(p.sum(axis=1)))


# --- the workload -----------------------------------------------------------------------------

class Workload:
    """Conversations over a few shared system prompts (a skewed choice), one turn per
    request: prompt = the conversation so far + a user message; output appended; committed."""

    def __init__(self, seed, prompts=6, conversations=24):
        self.rng = np.random.default_rng(seed)
        r = self.rng
        self.system = []
        for _ in range(prompts):
            toks = r.integers(1, 30000, size=int(r.integers(8, 25)) * PAGE).tolist()
            self.system.append(History().extend(toks)[0])
        weights = 1.0 / np.arange(1, prompts + 1)
        self.conversations = [self.system[int(r.choice(prompts, p=weights / weights.sum()))]
                              for _ in range(conversations)]

    def next_turn(self):
        """(conversation index, prompt History, output tokens)."""
        r = self.rng
        c = int(r.integers(len(self.conversations)))
        user = r.integers(1, 30000, size=int(r.integers(16, 49))).tolist()
        prompt = self.conversations[c].extend(user)[0]
        return c, prompt, r.integers(1, 30000, size=int(r.integers(8, 25))).tolist()


class Driver:
    def __init__(self, args):
        self.args = args
        self.cluster = os.environ["KVCD_TOPO_CLUSTER"]
        self.ttl = float(os.environ["KVCD_TOPO_LEASE_TTL_S"])
        self.redis = redis_py.Redis.from_url(os.environ["KVCD_TOPO_REDIS"], socket_timeout=2,
                                             socket_connect_timeout=2)
        self.etcd = os.environ["KVCD_TOPO_ETCD"]
        self.members = EtcdMembership(self.etcd, default_prefix(self.cluster))
        self.n = len(os.environ["KVCD_TOPO_MEMBERS"].split())
        if not self.members.wait_until(lambda m: len(m) == self.n, timeout=20):
            raise SystemExit(f"failures: {len(self.members.members())} of {self.n} members in etcd")
        self.index = BlockIndex(self.cluster, url=os.environ["KVCD_TOPO_REDIS"])
        self.cc = ClusterClient(self.members, self.index, config=RoutingConfig(),
                                timeout=5.0, options=CHANNEL_OPTIONS, down_s=10.0)
        self.work = Workload(args.seed)
        self.qrng = np.random.default_rng(args.seed + 1)
        self.phases = []
        self.wrong_details = []
        self.stop = threading.Event()  # never set: a bounded pause after a failed request

    # -- setup ---------------------------------------------------------------------------

    def register_model(self):
        """The workload's model on every member that lacks it."""
        pages = 2048
        page_bytes = 2 * 2 * PAGE * LAYERS * KV_HEADS * HEAD_DIM
        for member_id in sorted(self.members.members()):
            c = self.cc.client(member_id)
            # A member back from a cut: its channel may still be in reconnect backoff (at
            # most 1 s, CHANNEL_OPTIONS); wait for it to connect (bounded).
            c.wait_ready(10)
            try:
                c.register_model(name=MODEL, num_layers=LAYERS, num_q_heads=Q_HEADS,
                                 num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                                 recent_tokens=PAGE, history_format=kvcd.v1.kvcache_pb2.HISTORY_FORMAT_BF16,
                                 memory_bytes=pages * page_bytes)
            except kvcd.AlreadyExists:
                pass

    # -- checking ------------------------------------------------------------------------

    def check(self, session, history, phase, what):
        """Attention of a random query on every layer against the reference; counts a
        mismatch as a wrong result."""
        for layer in range(LAYERS):
            q = self.qrng.standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float32)
            o, lse = session.attention_decode(layer, q)
            ro, rl = reference_attention(q[0], history.k[layer], history.v[layer])
            if not (np.allclose(o[0], ro, rtol=1e-3, atol=1e-4)
                    and np.allclose(lse[0], rl, rtol=1e-4, atol=1e-4)):
                phase["wrong"] += 1
                if len(self.wrong_details) < 5:
                    self.wrong_details.append(
                        f"{phase['name']}: {what} on {session.member_id}, layer {layer}: "
                        f"max |o - ref| {float(np.abs(o[0] - ro).max()):.3g}")
                return False
        return True

    # -- one request -----------------------------------------------------------------------

    def request(self, phase):
        c, prompt, output = self.work.next_turn()
        phase["requests"] += 1
        phase["prompt_tokens"] += len(prompt.tokens)
        s = None
        try:
            s = self.cc.open(MODEL, prompt.tokens, k=prompt.k, v=prompt.v)
            phase["hit_tokens"] += s.sequence.matched_tokens
            self.check(s, prompt, phase, "open")
            full, k_out, v_out = prompt.extend(output)
            s.append(output, k_out, v_out)
            self.check(s, full, phase, "append")
            s.close(commit=True)
            phase["failovers"] += s.failovers
            self.work.conversations[c] = full
        except Exception as e:  # every failure of a request is counted, none stops the run
            phase["errors"] += 1
            if len(phase["error_samples"]) < 3:
                phase["error_samples"].append(f"{type(e).__name__}: {str(e)[:200]}")
            if s is not None and not s.closed:
                try:
                    s.close()
                except Exception:
                    pass
            # Through an outage (no member to route to) the loop does not spin: at most 20
            # failing requests a second.
            self.stop.wait(0.05)

    # -- sessions open through a failure ---------------------------------------------------------

    def open_long_sessions(self, phase, count):
        """Sessions that stay open across the phase (agents mid-decode), one step each
        request; returns [(session, history)]."""
        out = []
        for _ in range(count):
            _, prompt, _ = self.work.next_turn()
            try:
                s = self.cc.open(MODEL, prompt.tokens, k=prompt.k, v=prompt.v)
                out.append([s, prompt])
            except Exception as e:
                phase["errors"] += 1
                phase["error_samples"].append(f"open long session: {type(e).__name__}: {e}")
        return out

    def step_long_sessions(self, phase, sessions):
        for entry in sessions:
            s, hist = entry
            if s.closed:
                continue
            tok = [int(self.qrng.integers(1, 30000))]
            new, k1, v1 = hist.extend(tok)
            try:
                before = s.failovers
                s.append(tok, k1, v1)
                entry[1] = new
                self.check(s, new, phase, "decode step" + (" after failover" if s.failovers > before else ""))
            except Exception as e:
                phase["errors"] += 1
                if len(phase["error_samples"]) < 3:
                    phase["error_samples"].append(f"long session: {type(e).__name__}: {str(e)[:200]}")
                try:
                    s.close()
                except Exception:
                    pass

    def close_long_sessions(self, phase, sessions):
        for s, _ in sessions:
            phase["failovers"] += s.failovers
            try:
                s.close()
            except Exception:
                pass

    # -- phases --------------------------------------------------------------------------------

    def new_phase(self, name):
        p = {"name": name, "requests": 0, "errors": 0, "wrong": 0, "failovers": 0,
             "prompt_tokens": 0, "hit_tokens": 0, "error_samples": [], "measured": {}}
        self.phases.append(p)
        return p

    def run_until(self, phase, done, min_requests, limit_s, sessions=()):
        """Requests until done() and min_requests, at most limit_s seconds."""
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < limit_s:
            if n >= min_requests and done():
                return True
            self.request(phase)
            self.step_long_sessions(phase, sessions)
            n += 1
        return done()

    def held_key(self, member_id, incarnation):
        return f"kvcd:{{{self.cluster}}}:held:{member_id}:{incarnation}"

    def blk_fields_of(self, member_id):
        """blk: keys that still name member_id (a full scan)."""
        keys = list(self.redis.scan_iter(match=f"kvcd:{{{self.cluster}}}:blk:*", count=1000))
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hexists(key, member_id)
        return sum(bool(x) for x in pipe.execute()) if keys else 0

    def victim(self, sessions):
        """The member holding most of the open long sessions."""
        counts = {}
        for s, _ in sessions:
            counts[s.member_id] = counts.get(s.member_id, 0) + 1
        if not counts:
            raise SystemExit("failures: no long session could be opened")
        return max(sorted(counts), key=lambda m: counts[m])

    def lose_member(self, how):
        """A member killed (how='kill') or cut off (how='cut') with sessions open on it."""
        phase = self.new_phase(f"member-{how}")
        sessions = self.open_long_sessions(phase, 8)
        victim = self.victim(sessions)
        inc = self.members.members()[victim].incarnation
        phase["measured"]["member"] = victim
        phase["measured"]["sessions_on_it"] = sum(s.member_id == victim for s, _ in sessions)
        gone = threading.Event()
        t_gone = {}

        def watch():
            if self.members.wait_until(lambda m: victim not in m, timeout=self.ttl * 4 + 10):
                t_gone["t"] = time.monotonic()
            gone.set()

        self.run_until(phase, lambda: True, 5, 30, sessions)
        held = self.held_key(victim, inc)
        # What the index credited the member with (the purge below must remove it).
        phase["measured"]["held_before"] = self.redis.scard(held)
        phase["measured"]["blk_fields_before"] = self.blk_fields_of(victim)
        threading.Thread(target=watch, daemon=True).start()
        t0 = time.monotonic()
        ctl("kill" if how == "kill" else "cut", victim)
        self.run_until(phase, lambda: gone.is_set() and not self.redis.exists(held),
                       10, self.ttl * 4 + 15, sessions)
        m = phase["measured"]
        if "t" in t_gone:
            m["lease_end_s"] = round(t_gone["t"] - t0, 2)
        if not self.redis.exists(held):
            m["index_forgot_s"] = round(time.monotonic() - t0, 2)  # an upper bound
        m["blk_fields_left"] = self.blk_fields_of(victim)
        m["bound_s"] = round(self.ttl + self.ttl / 3, 2)
        self.run_until(phase, lambda: True, 10, 30, sessions)
        self.close_long_sessions(phase, sessions)
        # Back: a new incarnation after the kill, the same one after the cut.
        t1 = time.monotonic()
        if how == "kill":
            ctl("start", victim)
        else:
            ctl("restore", victim)
        back = self.members.wait_until(lambda ms: victim in ms, timeout=self.ttl * 4 + 10)
        m["back_s"] = round(time.monotonic() - t1, 2) if back else None
        if back:
            m["incarnation_changed"] = self.members.members()[victim].incarnation != inc
            # A restarted daemon knows only the models of its config: register ours again,
            # as the workers would on seeing a new incarnation.
            self.register_model()
        return phase

    def redis_restart(self):
        phase = self.new_phase("redis-restart")
        self.run_until(phase, lambda: True, 5, 30)
        live = self.members.members()
        before = {mid: self.redis.scard(self.held_key(mid, m.incarnation)) for mid, m in live.items()}
        phase["measured"]["held_before"] = sum(before.values())
        t0 = time.monotonic()
        ctl("restart", "redis")
        t_up = time.monotonic()

        def republished():
            try:
                return all(self.redis.scard(self.held_key(mid, m.incarnation)) >= before[mid]
                           for mid, m in live.items())
            except redis_py.RedisError:
                return False

        ok = self.run_until(phase, republished, 10, 30)
        phase["measured"]["restart_s"] = round(t_up - t0, 2)
        phase["measured"]["republished_s"] = round(time.monotonic() - t_up, 2) if ok else None
        self.run_until(phase, lambda: True, 10, 30)
        return phase

    def etcd_restart(self):
        phase = self.new_phase("etcd-restart")
        self.run_until(phase, lambda: True, 5, 30)
        t0 = time.monotonic()
        ctl("kill", "etcd")
        ctl("wipe-etcd")
        ctl("start", "etcd")
        t_up = time.monotonic()
        ok = self.run_until(phase, lambda: len(self.members.members()) == self.n, 5,
                            self.ttl * 4 + 20)
        phase["measured"]["restart_s"] = round(t_up - t0, 2)
        phase["measured"]["reregistered_s"] = round(time.monotonic() - t_up, 2) if ok else None
        self.run_until(phase, lambda: True, 10, 30)
        return phase

    def run(self):
        t0 = time.monotonic()
        self.register_model()
        steady = self.new_phase("steady")
        self.run_until(steady, lambda: True, self.args.warmup, 60)
        phases = {"member-kill": lambda: self.lose_member("kill"),
                  "member-cut": lambda: self.lose_member("cut"),
                  "redis-restart": self.redis_restart, "etcd-restart": self.etcd_restart}
        for name in self.args.phases.split(","):
            phases[name]()
        after = self.new_phase("after")
        self.run_until(after, lambda: True, self.args.warmup // 2, 60)
        for p in self.phases:
            p["hit_rate"] = round(p["hit_tokens"] / max(p["prompt_tokens"], 1), 4)
        return {"seconds": round(time.monotonic() - t0, 1), "lease_ttl_s": self.ttl,
                "members": self.n, "phases": self.phases, "wrong_details": self.wrong_details,
                "failures": self.verdict()}

    def verdict(self):
        """What broke the contract (empty: nothing)."""
        bad = []
        for p in self.phases:
            m = p["measured"]
            if p["wrong"]:
                bad.append(f"{p['name']}: {p['wrong']} wrong results")
            if p["name"] in ("steady", "member-kill", "member-cut", "after") and p["errors"]:
                bad.append(f"{p['name']}: {p['errors']} requests failed: {p['error_samples']}")
            if p["name"].startswith("member-"):
                slack = 1.0  # the watch's delivery and this process's scheduling
                if m.get("lease_end_s") is None or m["lease_end_s"] > m["bound_s"] + slack:
                    bad.append(f"{p['name']}: the lease ended after {m.get('lease_end_s')} s, "
                               f"bound TTL + TTL/3 = {m['bound_s']} s")
                if not m["held_before"] or not m["blk_fields_before"]:
                    bad.append(f"{p['name']}: the index credited {m['member']} with nothing "
                               f"before it was lost (held {m['held_before']}, blk: fields "
                               f"{m['blk_fields_before']}): the purge was not tested")
                if m.get("index_forgot_s") is None or m["blk_fields_left"]:
                    bad.append(f"{p['name']}: the index still holds {m['member']} "
                               f"({m['blk_fields_left']} blk: fields)")
                if m.get("sessions_on_it", 0) == 0:
                    bad.append(f"{p['name']}: no session was open on the lost member")
                if p["failovers"] == 0:
                    bad.append(f"{p['name']}: no session failed over")
                if m.get("back_s") is None:
                    bad.append(f"{p['name']}: {m['member']} did not come back")
                elif p["name"] == "member-kill" and not m.get("incarnation_changed"):
                    bad.append("member-kill: the restarted member kept its incarnation")
                elif p["name"] == "member-cut" and m.get("incarnation_changed"):
                    bad.append("member-cut: the member changed incarnation without a restart")
            if p["name"] == "redis-restart" and not m.get("held_before"):
                bad.append("redis-restart: nothing was in the index before the restart")
            if p["name"] == "redis-restart" and m.get("republished_s") is None:
                bad.append("redis-restart: the daemons did not republish")
            if p["name"] == "etcd-restart" and m.get("reregistered_s") is None:
                bad.append("etcd-restart: the members did not re-register")
        return bad


MEASURED = [("lease_end_s", "lease ended (s)"), ("index_forgot_s", "index forgot it (s, at most)"),
            ("back_s", "back in membership (s)"), ("republished_s", "republished (s)"),
            ("reregistered_s", "all re-registered (s)")]


def markdown(report):
    """The phases as a Markdown table (bench/results/)."""
    out = [f"{report['members']} daemons (CPU backend), lease TTL {report['lease_ttl_s']:g} s, "
           f"{report['seconds']} s in all; bound on the lease's end: TTL + TTL/3 = "
           f"{report['lease_ttl_s'] * 4 / 3:.2f} s.", "",
           "| phase | requests | errors | wrong results | hit rate | failovers | "
           + " | ".join(h for _, h in MEASURED) + " |",
           "|---|---:|---:|---:|---:|---:|" + "---:|" * len(MEASURED)]
    for p in report["phases"]:
        m = p["measured"]
        cells = [str(m[k]) if m.get(k) is not None else "" for k, _ in MEASURED]
        name = p["name"] + (f" ({m['member']}, {m['sessions_on_it']} open sessions on it)"
                            if "member" in m else "")
        out.append(f"| {name} | {p['requests']} | {p['errors']} | {p['wrong']} | "
                   f"{100 * p['hit_rate']:.1f}% | {p['failovers']} | " + " | ".join(cells) + " |")
    out.append("")
    for p in report["phases"]:
        for e in p["error_samples"]:
            out.append(f"- {p['name']} error: `{e}`")
    for b in report["failures"]:
        out.append(f"- FAIL: {b}")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--markdown", help="also write the phases as a Markdown table here")
    ap.add_argument("--seed", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=40, help="requests of the steady phase")
    ap.add_argument("--phases", default="member-kill,member-cut,redis-restart,etcd-restart",
                    help="the failures, in order (comma-separated)")
    args = ap.parse_args()
    d = Driver(args)
    try:
        report = d.run()
    finally:
        d.cc.close()
        d.members.close()
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(report))
    for p in report["phases"]:
        m = " ".join(f"{k}={v}" for k, v in p["measured"].items() if k != "held_before")
        print(f"failures: {p['name']:14} {p['requests']:4} requests {p['errors']:3} errors "
              f"{p['wrong']} wrong  hit rate {100 * p['hit_rate']:.1f}%  failovers "
              f"{p['failovers']}  {m}", file=sys.stderr)
    for b in report["failures"]:
        print(f"failures: FAIL {b}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
