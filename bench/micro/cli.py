"""``epd bench micro``: the argument parser and the command (kept import-light: heavy modules load on run)."""

from __future__ import annotations

import argparse
import sys

from bench.micro.compare import DEFAULT_TOLERANCE
from bench.micro.runner import BENCHMARKS, NAMES, UnknownBenchmark, select
from controlplane.cli_args import path_arg

DESCRIPTION = """\
One small benchmark per hot path, each reporting its figure beside a reference measured in the same
run, and the ratio of the two. Every figure is measured --repeats times, each time paired with its
reference; the table shows the median figure and reference and the ratio's median [min-max] over the
repeats (its run-to-run spread). The whole suite takes 1-1.5 minutes on 2 busy cores (--quick: about 30 s).

benchmarks:
""" + "\n".join(f"  {b.name:<10} {b.summary}" for b in BENCHMARKS) + """

--compare BASELINE.json flags each ratio whose [min-max] range no longer overlaps the baseline's and
whose median moved by more than --tolerance, and exits 1 if any moved the worse way (it names them).
Exit status: 0 all ran and nothing regressed; 1 a benchmark failed or a ratio regressed; 2 bad input.
"""


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no benchmark named; valid names: {', '.join(NAMES)}")
    try:
        select(names)
    except UnknownBenchmark as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a fraction in [0, 1) is expected (0.1 = 10%), got {value}")
    return value


def _repeats(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"at least 2 repeats are needed for a spread, got {value}")
    return value


def add_micro_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``micro`` under ``epd bench``."""
    p = bench.add_parser("micro", help="microbenchmarks of every hot path, each vs an in-run reference",
                         description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", type=_names, default=None, metavar="NAME[,NAME]",
                   help=f"run only these benchmarks (repeatable or a comma list): {', '.join(NAMES)}")
    p.add_argument("--quick", action="store_true",
                   help="reduced sizes and 3 repeats: a smoke run for CI (figures are not comparable with a full run)")
    p.add_argument("--repeats", type=_repeats, default=None,
                   help="paired repeats per figure, for the spread (default 5; 3 with --quick)")
    p.add_argument("--json", type=path_arg, default=None, metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--compare", type=path_arg, default=None, metavar="BASELINE.json",
                   help="compare the ratios with an earlier --json file; exit 1 if any regressed")
    p.add_argument("--tolerance", type=_tolerance, default=DEFAULT_TOLERANCE,
                   help="smallest relative change of a median ratio that --compare flags (default %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads in this process (default 1: what a replica runs with, since Ray sets "
                        "OMP_NUM_THREADS=1 for fractional CPUs; one thread also keeps the spread small on a busy "
                        "machine)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="clock of the in-process benchmarks (codec, scheduler, engine): cpu = this process's CPU "
                        "time, which discounts time given to other processes on a busy machine (default); wall = "
                        "elapsed time. Transfers and Redis always use wall time")
    p.add_argument("--model", type=path_arg, default=None,
                   help="HF checkpoint folder for the engine benchmark (default: the built-in demo model)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.micro.compare import compare, format_verdicts, regressions, setup_differences
    from bench.micro.results import ResultsFileError, SuiteRun
    from bench.micro.runner import format_table, run_suite, say
    from bench.micro.timing import Plan

    if args.list:
        for b in BENCHMARKS:
            print(f"{b.name:<10} {b.summary}")
        return 0
    baseline = None
    if args.compare is not None:  # read it first: a bad file should not cost a whole run
        try:
            baseline = SuiteRun.read(args.compare)
        except ResultsFileError as exc:
            print(f"epd bench micro: error: --compare: {exc}", file=sys.stderr)
            return 2
    if args.threads < 1:
        print(f"epd bench micro: error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    if args.model is not None and not args.model.is_dir():
        print(f"epd bench micro: error: --model {args.model} is not a folder", file=sys.stderr)
        return 2
    names = [n for group in args.only for n in group] if args.only else None
    repeats = args.repeats or (3 if args.quick else 5)
    plan = Plan(repeats=repeats, quick=args.quick, model=args.model, clock=args.clock)
    suite = run_suite(select(names), plan, log=say)
    print(format_table(suite))
    if args.json is not None:
        suite.write(args.json)
        say(f"wrote {args.json}")
    status = 1 if suite.errors else 0
    if suite.errors:
        print(f"epd bench micro: {len(suite.errors)} benchmark(s) failed: {', '.join(suite.errors)}", file=sys.stderr)
    if baseline is not None:
        verdicts = compare(baseline, suite, args.tolerance)
        print()
        print(format_verdicts(verdicts, str(args.compare)))
        for diff in setup_differences(baseline, suite):
            print(f"note: {diff}; the ratios are not like for like")
        bad = regressions(verdicts)
        if bad:
            print(f"epd bench micro: {len(bad)} ratio(s) regressed beyond their spread: "
                  f"{', '.join(v.name for v in bad)}", file=sys.stderr)
            status = 1
    return status
