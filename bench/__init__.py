"""The load-test harness and the benchmarks (``epd bench ...``): a client of everything below it.

Imports point one way: bench -> controlplane -> workers -> kvtransfer. Nothing below imports this package;
``epd``'s parser gets the ``bench`` subcommand through the ``epd.commands`` entry point (cli.py). Each
benchmark prints its figure beside a reference measured in the same run. What only this package needs is
the ``bench`` extra (``BENCH_EXTRA``; ``make setup`` installs it).

  cli.py                 the ``epd bench`` subcommands
  engine_bench.py        engine prefill/decode throughput beside HF transformers (gpu_engine_bench.py on CUDA)
  hf_reference.py        the HF transformers model those figures are measured against
  kv_bench.py            KV-transfer throughput and TTFT beside memcpy, TCP and raw gRPC (kv_references.py)
  kv_accuracy.py         token agreement of quantised KV transfer against the bf16 path
  controlplane_bench.py  control-plane added latency and requests/s beside a Ray Serve handle chain
  codec_bench.py         codec encode/decode GB/s beside memcpy (``python -m bench.codec_bench``)
  compare.py             one workload against disaggregated and colocated serving
  chaos/                 faults under load through a live deployment (``epd bench chaos``)
  micro/                 one microbenchmark per hot path, each a ratio to an in-run reference
  serve/                 the load tester of any OpenAI-compatible endpoint (``epd bench serve``)
  lean_http.py           the minimal keep-alive HTTP/1.1 client the load generators use
  otlp_sink.py           a minimal OTLP/gRPC receiver, for the tracing-cost benchmark and the tests
  train_checkpoint.py    trains the demo architecture for minutes, for accuracy figures a random model cannot give
"""

BENCH_EXTRA = ("httpx", "matplotlib", "tqdm", "transformers")  # the modules of pyproject.toml's bench extra
