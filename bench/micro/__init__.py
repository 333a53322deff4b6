"""``epd bench micro``: one small benchmark per hot path, each a ratio to a reference measured in the same run.

    results.py   Result / SuiteRun and their JSON form        timing.py    paired repeats (figure, reference)
    runner.py    the registry of benchmarks, the run, table   compare.py   --compare: moved beyond the spread?
    cli.py       the argparse parser and the command
    codec.py  kv_transfer.py (kv-grpc, kv-tcp, kv-shm)  scheduler.py  engine.py  redis_ops.py   the benchmarks

See docs/microbenchmarks.md.
"""
