"""``redis``: the worker registry's operations against a raw redis-py round trip, on a private redis-server.

A ``LocalRedis`` (redis-server on 127.0.0.1, no persistence) is started for the run and stopped after.
Figures, microseconds per operation through ``WorkerRegistry`` on a ``connect()`` connection (retries,
timeouts and key layout included, as the workers and the scheduler use it):
  register    one worker's hash and index entry (a Lua script, one round trip);
  heartbeat   new load and lease end for a registered worker (the same script);
  list        ``live_workers`` of a pool holding 64 workers (two pipelined round trips, 64 hashes decoded).
The reference is a plain ``redis.Redis`` client's SET of a short key (one round trip), measured in the
same repeat; a plain PING is measured too and given in each figure's note.
"""

from __future__ import annotations

import uuid

import redis

from bench.micro.results import Result
from bench.micro.timing import Plan, best, paired, per_call_us
from controlplane.state import LocalRedis, Pool, WorkerInfo, WorkerLoad, WorkerRegistry, connect

LIST_WORKERS = 64


def run(plan: Plan) -> list[Result]:
    calls = 100 if plan.quick else 300
    list_calls = max(5, calls // 20)
    with LocalRedis() as server:
        conn = connect(server.url, f"bench-{uuid.uuid4().hex[:12]}")
        raw = redis.Redis(host="127.0.0.1", port=server.port)
        registry = WorkerRegistry(conn, ttl=60.0)
        infos = [WorkerInfo(f"decode-{i:03d}", Pool.DECODE, f"127.0.0.1:{50000 + i}",
                            load=WorkerLoad(100, 8000, 16384, 4)) for i in range(LIST_WORKERS)]
        raw_key = f"{conn.keys.prefix}:raw"
        try:
            for info in infos:
                registry.register(info)
            one = infos[0]
            load = WorkerLoad(queued_tokens=512, free_kv_blocks=9000, total_kv_blocks=16384, running=7)
            set_us = per_call_us(lambda: raw.set(raw_key, "0123456789abcdef"), calls)
            ping_us = best(per_call_us(raw.ping, calls), 3)
            ops = {
                "register": (per_call_us(lambda: registry.register(one), calls), set_us),
                "heartbeat": (per_call_us(lambda: registry.heartbeat(one.worker_id, "decode", load), calls), set_us),
                "list": (per_call_us(lambda: registry.live_workers("decode"), list_calls),
                         per_call_us(lambda: raw.set(raw_key, "0123456789abcdef"), list_calls)),
            }
            out = []
            for op, (fig, ref) in ops.items():
                fig()  # warm-up (script load, connection)
                figs, refs = paired(fig, ref, plan)
                extra = f", a pool of {LIST_WORKERS} workers" if op == "list" else ""
                out.append(Result(f"redis.{op}", "redis", "us", "lower", "raw redis-py SET round trip",
                                  tuple(figs), tuple(refs),
                                  note=f"raw PING {ping_us:.1f} us{extra}; private redis-server on loopback"))
            if len(registry.live_workers("decode")) != LIST_WORKERS:
                raise RuntimeError("the registry lost workers during the benchmark")
        finally:
            for info in infos:
                registry.deregister(info.worker_id, "decode")
            raw.delete(raw_key)
            raw.close()
            conn.close()
    return out
