"""``epd bench serve``: its flags, and the command that turns them into a ``ServeBenchConfig`` and a report.

Bad input (a flag value, the URL, the dataset file, the SLO spec, an unreachable server) is printed as one
``epd bench serve: error: ...`` line and exits 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.serve.config import (
    BenchInputError,
    DatasetConfig,
    ServeBenchConfig,
    parse_float_list,
    parse_image_sizes,
    parse_slo,
)
from controlplane.cli_args import UsageError, check_writable, path_arg

DESCRIPTION = """\
Load-test any OpenAI-compatible endpoint (ours or anyone else's) with streaming requests, and report
TTFT, TPOT, ITL and E2E latency (mean, p50, p90, p99), request and token throughput, and SLO attainment and
goodput, with the definitions of vLLM's benchmark_serving. Requests arrive as a Poisson process (or gamma,
--burstiness) at --rate, or all at once bounded by --concurrency; --rate 1,2,4 sweeps rates.
Examples:
  epd bench serve --url http://127.0.0.1:8000 --num-prompts 200 --rate 4 --goodput ttft:500 tpot:50
  epd bench serve --url http://127.0.0.1:8000 --rate 1,2,4,8 --result-json out.json --plot-dir plots/
  epd bench serve --url http://127.0.0.1:8000 --dataset sharegpt --dataset-path sharegpt.json --concurrency 8
  epd bench serve --url http://127.0.0.1:8000 --dataset multimodal --image-sizes 224x224,336x336
vLLM's benchmark_serving flags work as they are (--base-url, --backend, --request-rate, --max-concurrency,
--dataset-name, --random-input-len, --random-output-len, --random-range-ratio, --save-result, --result-dir,
--result-filename, --percentile-metrics, --metric-percentiles, --disable-tqdm), and its flat keys
(mean_ttft_ms, p99_ttft_ms, ...) sit beside epd's own in the JSON:
  epd bench serve --dataset-name random --random-input-len 256 --random-output-len 64 --request-rate 4 \\
      --max-concurrency 8 --save-result --result-filename run.json --percentile-metrics ttft,tpot,itl,e2el
The URL defaults to http://127.0.0.1:8000. Random prompts are exactly --input-len tokens as the server counts
them (its /tokenize; chat prompts with the template).
See docs/benchmarking.md for what each figure means."""


def add_serve_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``serve`` under the ``epd bench`` subcommands."""
    p = bench.add_parser("serve", help="load-test an OpenAI-compatible endpoint: latency, throughput, goodput",
                         description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--url", "--base-url", default=None,
                   help="the server (a /v1 suffix is optional; default http://HOST:PORT, i.e. http://127.0.0.1:8000)")
    t.add_argument("--host", default="127.0.0.1", help="with no --url: the server's host (default 127.0.0.1)")
    t.add_argument("--port", type=int, default=8000, help="with no --url: the server's port (default 8000)")
    t.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    t.add_argument("--endpoint", type=_endpoint, default=None,
                   help="chat or completions (or vLLM's /v1/chat/completions, /v1/completions) (default: chat "
                        "for --dataset multimodal, completions otherwise)")
    t.add_argument("--backend", choices=("vllm", "openai", "openai-chat"), default=None,
                   help="vLLM's flag: openai-chat = --endpoint chat; vllm, openai = --endpoint completions "
                        "(default: --endpoint decides)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", "--dataset-name", choices=("random", "sharegpt", "prefix", "multimodal"),
                   default="random",
                   help="random text; a ShareGPT JSON file; N shared prefixes + unique suffixes; random text "
                        "with generated PNG images (default: random)")
    d.add_argument("--dataset-path", type=path_arg, default=None, help="the ShareGPT-format JSON file")
    d.add_argument("--num-prompts", type=int, default=100, help="requests per load point (default 100)")
    d.add_argument("--input-len", "--random-input-len", type=int, default=256,
                   help="prompt tokens (prefix: the unique suffix's tokens) (default 256)")
    d.add_argument("--output-len", "--random-output-len", type=int, default=64,
                   help="max_tokens per request (default 64)")
    d.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="draw lengths uniformly from [len*(1-r), len*(1+r)] (default 0: fixed)")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="max_tokens for ShareGPT (default: the reference answer's length)")
    d.add_argument("--num-prefixes", type=int, default=4, help="prefix dataset: shared prefixes (default 4)")
    d.add_argument("--prefix-len", type=int, default=256, help="prefix dataset: tokens per prefix (default 256)")
    d.add_argument("--image-sizes", default="224x224", help="multimodal: WxH[,WxH...] cycled (default 224x224)")
    d.add_argument("--images-per-request", type=int, default=1, help="multimodal: images per request (default 1)")
    d.add_argument("--tokenizer", type=path_arg, default=None,
                   help="HF folder or tokenizer.json to count prompt tokens locally (default: the server's own "
                        "/tokenize; a server without it gets common words, about one token each)")

    ld = p.add_argument_group("load")
    ld.add_argument("--rate", "--request-rate", default="inf",
                    help="requests/s, or a comma list to sweep (e.g. 1,2,4); inf = all at once (default inf)")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier (default 1)")
    ld.add_argument("--concurrency", "--max-concurrency", type=int, default=None,
                    help="at most this many requests in flight (with --rate inf: a fixed concurrency) "
                         "(default: no limit)")
    ld.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first (default 2)")
    ld.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default 0)")
    ld.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ld.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos (vLLM/SGLang extension) so every answer runs to max_tokens")

    o = p.add_argument_group("SLOs and output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput and attainment: ttft, tpot and/or e2e bounds in ms, e.g. "
                        "--goodput ttft:500 tpot:50")
    o.add_argument("--result-json", type=path_arg, default=None, help="write every figure (and each request) here")
    o.add_argument("--save-result", action="store_true",
                   help="vLLM's flag: write the JSON to --result-dir/--result-filename (default name: "
                        "BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    o.add_argument("--result-dir", type=path_arg, default=None, help="with --save-result: the folder (default .)")
    o.add_argument("--result-filename", default=None, help="with --save-result: the file name")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="vLLM's flat keys: metrics to report percentiles of, from ttft,tpot,itl,e2el "
                        "(default ttft,tpot,itl)")
    o.add_argument("--metric-percentiles", default="99",
                   help="vLLM's flat keys: the percentiles, e.g. 50,90,99 (default 99)")
    o.add_argument("--plot-dir", type=path_arg, default=None,
                   help="write latency_cdf.png (and, with --goodput, slo_attainment.png, goodput.png) here")
    o.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench_serve)
    return p


def _endpoint(text: str) -> str:
    """``chat`` / ``completions``, or vLLM's endpoint paths for them."""
    known = {"chat": "chat", "completions": "completions", "/v1/chat/completions": "chat",
             "/v1/completions": "completions"}
    if text not in known:
        raise argparse.ArgumentTypeError(f"{text!r}: use chat, completions, /v1/chat/completions or /v1/completions")
    return known[text]


def saved_path(args: argparse.Namespace, result: Any) -> Path:
    """Where --save-result writes: --result-dir / (--result-filename or vLLM's default name)."""
    name = args.result_filename
    if name is None:
        point = result.points[0].metrics if result.points else None
        rate = "inf" if point is None or point.request_rate is None else f"{point.request_rate:g}"
        conc = f"-concurrency{args.concurrency}" if args.concurrency else ""
        backend = "openai-chat" if result.endpoint == "chat" else "openai"
        date = datetime.fromisoformat(result.started_at).strftime("%Y%m%d-%H%M%S")
        name = f"{backend}-{rate}qps{conc}-{result.model.split('/')[-1]}-{date}.json"
    return (args.result_dir or Path(".")) / name


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The flags as a validated ``ServeBenchConfig``. Raises BenchInputError."""
    dataset = DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, path=args.dataset_path, sharegpt_output_len=args.sharegpt_output_len,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        image_sizes=tuple(parse_image_sizes(args.image_sizes)), images_per_request=args.images_per_request,
        tokenizer=args.tokenizer)
    endpoint = args.endpoint
    if args.backend is not None:
        from_backend = "chat" if args.backend == "openai-chat" else "completions"
        if endpoint is not None and endpoint != from_backend:
            raise BenchInputError(f"--backend {args.backend} sends to {from_backend}, but --endpoint says {endpoint}")
        endpoint = from_backend
    config = ServeBenchConfig(
        url=args.url or f"http://{args.host}:{args.port}", model=args.model, endpoint=endpoint,
        api_key=args.api_key or None, dataset=dataset,
        rates=tuple(parse_float_list(args.rate, "rate", allow_inf=True)), concurrency=args.concurrency,
        burstiness=args.burstiness, warmup=args.warmup, seed=args.seed, temperature=args.temperature,
        ignore_eos=args.ignore_eos, slo=parse_slo(args.goodput), request_timeout_s=args.request_timeout,
        progress=not args.no_progress,
        percentile_metrics=tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip()),
        metric_percentiles=tuple(parse_float_list(args.metric_percentiles, "percentile")))
    config.validate()
    try:  # where the report goes, before the run rather than after it
        check_writable("--result-json", args.result_json, parents_made=True)  # write_json makes its folder
        check_writable("--plot-dir", args.plot_dir, folder=True)
        if args.save_result:
            check_writable("--result-dir", args.result_dir or Path("."), folder=True)
    except UsageError as exc:
        raise BenchInputError(str(exc)) from None
    return config


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from bench.serve.report import format_summary, write_json, write_report
    from bench.serve.runner import run_serve_bench

    try:
        config = config_from_args(args)
        result = run_serve_bench(config)
    except BenchInputError as exc:
        print(f"epd bench serve: error: {exc}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"epd bench serve: note: {note}", file=sys.stderr)
    print(format_summary(result))
    try:
        written = write_report(result, args.result_json, args.plot_dir)
        if args.save_result:
            written.append(write_json(result, saved_path(args, result)))
    except OSError as exc:
        print(f"epd bench serve: error: cannot write the report: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0
