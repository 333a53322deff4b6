"""``epd bench chaos``'s parser (the run imports its modules only when it starts)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

from controlplane.cli_args import UsageError, check_writable, model_dir, path_arg

DESCRIPTION = ("Drive a steady greedy load through a live `epd serve` (2+ replicas per pool) while Redis is "
               "restarted, one replica of each pool is killed (kill -9) and one decode replica is stopped "
               "(SIGSTOP) for a while. Reports completed, failed and migrated requests, agreement with "
               "generate(), KV blocks left held, time to replace each replica and p50/p99 latency before, "
               "during and after each fault. --soak MINUTES instead runs a steady 70% load and reports each "
               "process's memory growth (RSS and anonymous), each worker's memory per request, its memory "
               "once idle, and block drift; --mix makes that load a mixed one (streams, long prompts, "
               "images, sampled chats, clients that leave early, malformed bodies). Linux only (it finds "
               "worker processes through /proc).")


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
        return value
    return parse


def add_chaos_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser("chaos", help="faults under load: kill/stop replicas, restart Redis; nothing may be lost",
                         description=DESCRIPTION)
    p.add_argument("--model", type=path_arg, default=None, help="checkpoint folder (default: the demo model)")
    p.add_argument("--requests", type=_positive(int), default=300, help="requests to send at least (default 300)")
    p.add_argument("--concurrency", type=_positive(int), default=8, help="requests in flight (default 8)")
    p.add_argument("--max-tokens", type=_positive(int), default=32, help="tokens per answer (default 32)")
    p.add_argument("--replicas", type=_positive(int), default=2, help="replicas per pool (default 2)")
    p.add_argument("--baseline-s", type=_positive(float), default=20.0, help="fault-free load first (default 20)")
    p.add_argument("--settle-s", type=_positive(float), default=10.0,
                   help="quiet load after each fault, and the before/after windows (default 10)")
    p.add_argument("--stop-s", type=_positive(float), default=10.0, help="how long SIGSTOP lasts (default 10)")
    p.add_argument("--soak", type=_positive(float), default=None, metavar="MINUTES",
                   help="instead: a steady 70%% load for MINUTES, reporting memory and block drift")
    p.add_argument("--mix", action="store_true",
                   help="with --soak: a mixed load instead of greedy completions (streams, long prompts, "
                        "images, sampled chats, clients that close early or give up in prefill, malformed "
                        "bodies that must be refused); each kind is checked for how it must end")
    p.add_argument("--idle-s", type=_non_negative, default=None, metavar="SECONDS",
                   help="with --soak: read memory again this long after the load stops, past the replicas' "
                        "quiet trim ({pool}.trim_memory_quiet_s: 30 quiet seconds, looked for every 5 s, "
                        "after the last requests end); 0 = don't (default 60)")
    p.add_argument("--json", type=path_arg, default=None, help="also write the report as JSON here")
    p.add_argument("--keep-log", type=path_arg, default=None, help="copy epd serve's log here at the end")
    p.set_defaults(func=cmd_bench_chaos)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number, got {text}")
    return value


def cmd_bench_chaos(args: argparse.Namespace) -> int:
    if args.soak is None and (args.mix or args.idle_s is not None):
        flag = "--mix" if args.mix else "--idle-s"
        raise UsageError(f"{flag} shapes the soak: give it with --soak MINUTES")
    from bench.chaos.report import format_report, format_soak
    from bench.chaos.run import ChaosConfig, chaos, soak

    if args.model is not None:  # before the stack starts: a bad flag costs nothing
        model_dir(args.model)
    check_writable("--json", args.json)
    check_writable("--keep-log", args.keep_log)

    cfg = ChaosConfig(model=args.model, requests=args.requests, concurrency=args.concurrency,
                      max_tokens=args.max_tokens, replicas=args.replicas, baseline_s=args.baseline_s,
                      settle_s=args.settle_s, stop_s=args.stop_s, soak_minutes=args.soak, mix=args.mix,
                      idle_s=60.0 if args.idle_s is None else args.idle_s, keep_log=args.keep_log)
    if cfg.soak_minutes is not None:
        s = soak(cfg)
        print(format_soak(s))
        data, ok = s.as_dict(), s.ok
    else:
        r = chaos(cfg)
        print(format_report(r))
        data, ok = r.as_dict(), r.failed == 0 and r.matched == r.completed and r.blocks_leaked == 0
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=2, default=str))
    return 0 if ok else 1
