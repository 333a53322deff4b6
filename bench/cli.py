"""``epd bench ...``: the benchmarks' and the load-test harness's command line.

The ``bench`` package sits one floor above the control plane, so ``controlplane.cli`` never imports it: the
package registers ``add_bench_parser`` under the ``epd.commands`` entry-point group (pyproject.toml), and
``epd``'s parser calls every function registered there. Parsers only here; each command imports its
(heavy) module when it runs.

  epd bench engine|kv|kv-accuracy|controlplane   benchmarks, each beside a reference measured in the same run
  epd bench micro         one microbenchmark per hot path, each a ratio to an in-run reference (--compare)
  epd bench compare       one workload against disaggregated and colocated serving: the goodput ratio
  epd bench serve --url U  load-test an OpenAI-compatible endpoint: TTFT/TPOT/ITL/E2E, throughput, SLO goodput
  epd bench chaos         faults under load (kill/stop replicas, restart Redis): nothing lost, latency bounded
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from bench.chaos.cli import add_chaos_parser
from bench.compare import add_compare_parser
from bench.micro.cli import add_micro_parser
from bench.serve.cli import add_serve_parser
from controlplane.cli_args import UsageError, add_engine_args, check_positive, check_threads, check_writable, path_arg

# The bench extra's modules (pip install 'epd[bench]'; make setup installs it) a suite imports whatever its
# flags, checked before it starts: a missing one is one line naming the install, not a traceback, and never
# after a finished run whose report then could not be written.
_BENCH_EXTRA_NEEDS: dict[str, tuple[str, ...]] = {
    "serve": ("httpx",), "compare": ("httpx", "matplotlib"), "chaos": ("httpx",), "controlplane": ("httpx",)}


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from bench.engine_bench import run
    return run(args)


def _check_kv_args(args: argparse.Namespace) -> None:
    """``epd bench kv``'s flags, before anything is measured (UsageError naming the flag)."""
    import torch

    from kvtransfer.codecs import CodecError, get_codec

    check_positive(args, "--repeats", "--ttft-tokens")
    check_threads(args)
    if args.paired is not None and args.paired < 0:
        raise UsageError(f"--paired must be 0 or more, got {args.paired}")
    try:
        get_codec(args.ttft_codec)
    except CodecError as exc:
        raise UsageError(f"--ttft-codec: {exc}") from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible here; use --device cpu")
    check_writable("--json", args.json)


def cmd_bench_kv(args: argparse.Namespace) -> int:
    _check_kv_args(args)
    if args.device == "cuda":
        from bench.kv_gpu_bench import run as run_gpu
        return run_gpu(args)
    from bench.kv_bench import run
    return run(args)


def cmd_bench_controlplane(args: argparse.Namespace) -> int:
    from bench.controlplane_bench import run

    check_positive(args, "--requests", "--throughput-requests", "--concurrency", "--observability-tokens")
    if args.observability_cost < 0:
        raise UsageError(f"--observability-cost takes a number of rounds >= 0, got {args.observability_cost}")
    check_writable("--json", args.json)
    return run(args)


def cmd_bench_kv_accuracy(args: argparse.Namespace) -> int:
    from bench.kv_accuracy import run
    return run(args)


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench`` and its suites under ``epd``'s subcommands."""
    bench = sub.add_parser("bench", help="benchmarks and the load-test harness").add_subparsers(
        dest="bench_command", required=True, metavar="SUITE")
    eng = bench.add_parser("engine", help="engine prefill/decode throughput vs HF transformers",
                           description="Decode tokens/s at batch 1/8/16/32 and prefill tokens/s at 128/1k/4k "
                                       "tokens, beside HF transformers generate() and forward on the same "
                                       "checkpoint and thread count, measured in the same run. With --device "
                                       "cuda: decode at batch 1 and 128 and prefill of 2,048 tokens beside "
                                       "transformers on the same GPU, the weights-over-copy-rate roofline, the KV "
                                       "pool, peak GPU memory and the CUDA graphs' capture time.")
    add_engine_args(eng)
    eng.add_argument("--batches", default=None, help="decode batch sizes (default: 1,8,16,32; on cuda 1,128)")
    eng.add_argument("--prefill-lengths", default=None,
                     help="prompt lengths (default: 128,1024,4096; on cuda 2048)")
    eng.add_argument("--decode-tokens", type=int, default=64,
                     help="tokens generated per sequence (default: %(default)s)")
    eng.add_argument("--repeats", type=int, default=3, help="take the best of this many runs (default: %(default)s)")
    eng.add_argument("--json", type=path_arg, default=None, help="also write the results as JSON here")
    eng.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    eng.set_defaults(func=cmd_bench_engine)

    kv = bench.add_parser("kv", help="KV-transfer throughput and TTFT vs memcpy, TCP and raw gRPC",
                          description="Push whole KV caches (the demo model's 4k-token cache and a 256 MiB "
                                      "synthetic one) through every codec and transport to a receiver process "
                                      "on loopback, beside memcpy, a raw TCP socket and raw gRPC streams "
                                      "measured in the same run; then the TTFT of a streamed prefill.")
    kv.add_argument("--repeats", type=int, default=3, help="best of this many pushes (default 3)")
    kv.add_argument("--quick", action="store_true", help="only the 4k-token cache, 64 MiB references")
    kv.add_argument("--ttft-tokens", type=int, default=2048,
                    help="prompt length for the TTFT figure (default: %(default)s)")
    kv.add_argument("--ttft-codec", default="bf16", help="codec for the TTFT figure (default bf16)")
    kv.add_argument("--threads", type=int, default=None,
                    help="torch threads in the sender process (default: torch's choice)")
    kv.add_argument("--paired", type=int, default=None, metavar="N",
                    help="then N pushes of the largest cache as int8 over tcp (into an int8 and a bf16 cache) "
                         "and over shared memory (into an int8 cache), each paired with its reference moving "
                         "the same bytes (a TCP socket; a memcpy); prints the pairs' median ratio (default 8, "
                         "or 0 with --quick; 0: skip)")
    kv.add_argument("--paired-only", action="store_true",
                    help="run only the paired pushes (--paired N of them, default 8), nothing else first")
    kv.add_argument("--json", type=path_arg, default=None, help="also write the results as JSON here")
    kv.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the GPU KV path instead (fused codec kernels and a cuda_ipc push vs a device copy, "
                         "int8 over tcp from GPU memory vs a TCP socket, a 4,096-token TTFT on the 1b preset per "
                         "transport); needs a CUDA device")
    kv.set_defaults(func=cmd_bench_kv)

    acc = bench.add_parser("kv-accuracy", help="token agreement of quantised KV transfer vs the bf16 path",
                           description="64 prompts x 64 greedy tokens through the real transfer per codec "
                                       "policy; free-running and teacher-forced agreement with the bf16 path.")
    add_engine_args(acc)
    acc.add_argument("--policy", action="append", default=None,
                     help="codec policy to evaluate, repeatable (default: fp8, int8, int4, int4,0=bf16,-1=bf16 "
                          "and auto)")
    acc.add_argument("--prompts", type=int, default=64, help="prompts to compare (default: %(default)s)")
    acc.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default: %(default)s)")
    acc.set_defaults(func=cmd_bench_kv_accuracy)

    cp = bench.add_parser("controlplane", help="control-plane added latency and 1-token req/s vs Ray Serve",
                          description="Start the whole stack in this process (private redis-server, Ray, the "
                                      "three pools, the API on loopback) and send 1-token completions: median "
                                      "added latency (end-to-end minus the worker's compute, measured in the "
                                      "same run) at concurrency 1 and requests/s at --concurrency, beside a "
                                      "Ray Serve 3-hop handle chain measured in the same run.")
    cp.add_argument("--requests", type=int, default=200, help="sequential requests (default %(default)s)")
    cp.add_argument("--throughput-requests", type=int, default=640,
                    help="requests for the throughput figure (default %(default)s)")
    cp.add_argument("--concurrency", type=int, default=32, help="concurrent requests (default %(default)s)")
    cp.add_argument("--json", type=path_arg, default=None, help="also write the results as JSON here")
    cp.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the workers' compute dtype, and the local engine's for the compute figures "
                         "(default %(default)s, as serving runs weights)")
    cp.add_argument("--observability-cost", type=int, default=0, metavar="ROUNDS",
                    help="also price metrics + tracing: ROUNDS pairs of 160-request throughput runs on the "
                         "same stack, switched off and on (16 pairs take ~30 s and give a steadier median "
                         "than fewer; spans exported over OTLP to a local receiver, sampled as OTEL_TRACES_SAMPLER* "
                         "say: unset, one new request in ten; always_on: every span; with "
                         "OTEL_TRACES_EXPORTER=none not exported), and print the "
                         "on/off requests/s and CPU-per-request ratios (target >= 0.95); 0 = skip (default)")
    cp.add_argument("--observability-tokens", type=int, default=1, metavar="T",
                    help="completion tokens per request in the --observability-cost rounds (default %(default)s: "
                         "the worst case, all overhead; with T > 1 each run is 3 requests per connection)")
    cp.set_defaults(func=cmd_bench_controlplane)

    add_micro_parser(bench)
    add_compare_parser(bench)
    add_serve_parser(bench)
    add_chaos_parser(bench)
    for name, suite in bench.choices.items():
        suite.set_defaults(func=_checking_bench_extra(name, suite.get_default("func")))


def missing_from_bench_extra(suite: str, args: argparse.Namespace) -> list[str]:
    """The bench extra's modules that ``epd bench <suite>`` with these arguments would import and cannot."""
    needs = list(_BENCH_EXTRA_NEEDS.get(suite, ()))
    if suite == "serve" and getattr(args, "plot_dir", None) is not None:
        needs.append("matplotlib")
    missing = []
    for name in needs:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _checking_bench_extra(suite: str, func: Callable[[argparse.Namespace], int]
                          ) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        missing = missing_from_bench_extra(suite, args)
        if missing:
            raise UsageError(f"epd bench {suite} needs {' and '.join(missing)}, from the bench extra: "
                             f"pip install {' '.join(missing)} (make setup installs it)")
        return func(args)
    return run
