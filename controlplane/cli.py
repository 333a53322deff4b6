"""The ``epd`` command line.

  epd serve               start Redis, Ray, the three pools and the OpenAI-compatible API
  epd status|scale|drain  operate a running deployment through its admin API
  epd model init DIR      write the built-in demo model (random weights) as an HF checkpoint folder
                          (``--preset 1b``: a 1.1B Llama shape with random weights, for benchmarks)
  epd generate ...        generate from a prompt with the single-process engine (the reference path)
  epd config show|schema  the effective settings (secrets masked) / their JSON schema
  epd bench ...           benchmarks and the load-test harness: the ``bench`` package's own subcommands

Commands from other installed packages join through the ``epd.commands`` entry-point group: each entry is a
function that adds its subparsers (``bench.cli:add_bench_parser``). The control plane never imports them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from controlplane.cli_args import UsageError, add_engine_args, check_engine_args, model_dir, path_arg, replicas_arg

if TYPE_CHECKING:  # settings import pydantic and the policies: loaded by the commands that need them
    from controlplane.settings import Settings

COMMAND_PLUGINS = "epd.commands"


def cmd_model_init(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    from workers.runtime.default_model import write_default_checkpoint

    folder: Path = args.dir
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be an integer in [0, 2^63), got {args.seed}")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a folder")
    created = not folder.exists()
    try:
        if not created and any(folder.iterdir()) and not args.force:
            raise UsageError(f"{folder} exists and is not empty; pass --force to overwrite")
        if args.preset is not None:
            from workers.runtime.presets import write_preset_checkpoint
            write_preset_checkpoint(folder, args.preset, seed=args.seed)
        else:
            write_default_checkpoint(folder, seed=args.seed, with_vision=not args.no_vision)
    except (OSError, SafetensorError) as exc:
        if created:  # a half-written folder would look like a checkpoint: only what was there before stays
            shutil.rmtree(folder, ignore_errors=True)
        filename = getattr(exc, "filename", None)
        where = f" ({filename})" if filename and str(filename) != str(folder) else ""
        why = getattr(exc, "strerror", None) or exc
        raise UsageError(f"cannot write the model to {folder}{where}: {why}") from None
    what = f"preset {args.preset}" if args.preset is not None else "the demo model"
    print(f"wrote {what} (random weights, seed {args.seed}) to {folder}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from workers.runtime.engine import DTYPES, Engine, EngineConfig
    from workers.runtime.generate import GenerateRequest, build_prompt
    from workers.runtime.loader import load_model
    from workers.runtime.sampler import SamplingParams

    check_engine_args(args)
    images = tuple(_read_image(p) for p in args.image)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_model(model_dir(args.model), dtype=DTYPES[args.dtype], device=args.device)
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.chat is not None or images:
        text = args.chat if args.chat is not None else prompt
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        req = GenerateRequest(messages=[{"role": "user", "content": parts}], images=images)
    else:
        req = GenerateRequest(prompt=prompt)
    ids, mm = build_prompt(bundle, req)
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(dtype=args.dtype, device=args.device),
                    bundle.eos_token_ids)
    engine.add_request("cli", ids, params, mm)
    start = time.perf_counter()
    first = None
    n = 0
    reason = None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or time.perf_counter()
            n += len(out.new_token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
            reason = out.finish_reason
    end = time.perf_counter()
    ttft = (first or end) - start
    tps = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
    reason_name = reason.value if reason is not None else "none"
    print(flush=True)  # the text ends its line on stdout, whatever stderr goes to
    print(f"[{n} tokens, prompt {len(ids)} tokens, finish={reason_name}, "
          f"ttft={ttft * 1e3:.1f} ms, {tps:.1f} tok/s]", file=sys.stderr)
    return 0


def _read_image(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"--image {path}: cannot read it: {exc.strerror or exc}") from None


def cmd_config_show(args: argparse.Namespace) -> int:
    import json

    import yaml

    from controlplane.settings import Settings
    data = Settings.load(args.config).redacted()
    print(json.dumps(data, indent=2) if args.json else yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    import json

    from controlplane.settings import Settings
    print(json.dumps(Settings.model_json_schema(), indent=2))
    return 0


def _settings(args: argparse.Namespace) -> Settings:
    """Settings from --config, EPD_* and the flags given (flags win)."""
    from controlplane.settings import Settings, SettingsError

    overrides: dict = {}
    given: dict[str, str] = {}  # setting -> the flag that set it, for the error that names it
    for flag, path in (("model", ("model",)), ("mode", ("mode",)), ("host", ("api", "host")),
                       ("port", ("api", "port")), ("ray_address", ("ray", "address")),
                       ("redis_url", ("redis", "url"))):
        value = getattr(args, flag, None)
        if value is not None:
            node = overrides
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = str(value) if isinstance(value, Path) else value
            given[".".join(path)] = "--" + flag.replace("_", "-")
    try:
        return Settings.load(getattr(args, "config", None), overrides)
    except SettingsError as exc:
        message = str(exc)
        for setting, flag in given.items():
            for prefix in ("invalid settings: ", ""):
                lead = f"{prefix}{setting}: "
                if message.startswith(lead):  # the flag's value was refused: name the flag the user typed
                    raise SettingsError(f"{prefix}{flag} ({setting}): {message[len(lead):]}") from None
        raise


def cmd_serve(args: argparse.Namespace) -> int:
    from controlplane.serve import serve
    return serve(_settings(args))


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from controlplane.admin_client import AdminError, api_url, call, format_status, serving_degraded
    settings = _settings(args)
    try:
        data = call(settings, "GET", "/admin/pools", url=args.url)
    except AdminError as exc:  # e.g. Redis away: say how the API is serving meanwhile, when it says (briefly:
        degraded = serving_degraded(settings, args.url, timeout=1.0)  # an API that timed out already cost 10 s)
        if degraded is None:
            raise
        raise AdminError(f"{exc} (serving degraded: {degraded})") from None
    degraded = serving_degraded(settings, args.url)
    try:
        text = (json.dumps({**data, "degraded": degraded}, indent=2) if args.json else
                format_status(data) + (f"\nserving degraded: {degraded}" if degraded else ""))
    except (KeyError, TypeError) as exc:
        raise AdminError(f"the reply of {api_url(settings, args.url)}/admin/pools lacks {exc}; "
                         f"is it an epd API of this version?") from None
    print(text)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from controlplane.admin_client import AdminError, api_url, call
    settings = _settings(args)
    body = {"replicas": args.replicas, **({"force": True} if args.force else {})}
    reply = call(settings, "PUT", f"/admin/pools/{args.pool}", body, url=args.url)
    if "pool" not in reply or "target" not in reply:
        raise AdminError(f"the reply of {api_url(settings, args.url)}/admin/pools/{args.pool} lacks the pool "
                         f"and its target; is it an epd API of this version?")
    print(f"{reply['pool']}: target {reply['target']} replicas (the pool manager reconciles; see `epd status`)")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    from controlplane.admin_client import call
    if not args.worker.strip():
        raise UsageError("a worker id is required: the id `epd status` lists for it")
    path = f"/admin/workers/{quote(args.worker, safe='')}/drain"
    if args.undo:
        call(_settings(args), "DELETE", path, None, url=args.url)
        print(f"{args.worker}: serving (takes new work again)")
        return 0
    call(_settings(args), "POST", path, {}, url=args.url)
    print(f"{args.worker}: draining (no new work; in-flight requests finish; undo with "
          f"`epd drain {shlex.quote(args.worker)} --undo`)")
    return 0


Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _command_plugins() -> list[Register]:
    """The subparser builders installed packages register under ``epd.commands``, by entry name. One that
    cannot be imported becomes a command that says so when run: epd's own commands never depend on it."""
    plugins = []
    for ep in sorted(entry_points(group=COMMAND_PLUGINS), key=lambda ep: ep.name):
        try:
            plugins.append(ep.load())
        except ImportError as exc:
            plugins.append(_unavailable(ep.name, exc))
    return plugins


def _unavailable(name: str, exc: ImportError) -> Register:
    def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        p = sub.add_parser(name, help=f"(unavailable here: {exc})", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args: _refuse(f"epd {name} cannot be imported here ({exc}); install epd with "
                                                 f"its '{name}' extra (make setup installs every extra)"))
    return register


def _refuse(message: str) -> int:
    raise UsageError(message)


DEFAULT_PROMPT = "Hello, world."  # epd generate without --prompt or --chat


class _Parser(argparse.ArgumentParser):
    """argparse, with a malformed command line refused in one line as every other input error is (argparse
    prints its usage block first), pointing at the ``--help`` of the command it was meant for: an unknown
    option is refused by the command that does not know it (argparse leaves that to ``epd`` itself), and an
    option before any command is named, not taken for a missing command."""

    has_commands = False

    def add_subparsers(self, **kwargs: Any) -> Any:  # typeshed spells it as two overloads
        self.has_commands = True
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]  # typeshed's overloads
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        arg_list = list(sys.argv[1:] if args is None else args)
        first = arg_list[0] if arg_list else ""
        if self.has_commands and first.startswith("-") and first not in ("-h", "--help", "--version"):
            self.error(f"unrecognized arguments: {arg_list[0]}: a command comes first, then its options")
        parsed, extras = super().parse_known_args(arg_list, namespace)
        if extras and not self.has_commands:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _VersionAction(argparse.Action):
    """``epd --version``: the package version and the digest of the code it runs (``code_version``), the same
    string ``epd status`` shows for a worker whose code differs from the API's. Computed only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        from controlplane.code_version import code_version
        print(f"epd {code_version()}")  # to stdout, as argparse's own version action
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(prog="epd", description="epd: disaggregated encode/prefill/decode "
                                                                       "serving.")
    parser.add_argument("--version", action=_VersionAction, help="print the version and the code's digest")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="model checkpoints").add_subparsers(dest="model_command", required=True,
                                                                             metavar="ACTION")
    init = model.add_parser("init", help="write the built-in demo model (random weights) as an HF folder",
                            description="Write the built-in demo model as a Hugging Face checkpoint folder: "
                                        "config.json, model.safetensors, tokenizer files, chat template and a "
                                        "CLIP-style vision/ encoder. Its weights are random (deterministic from "
                                        "--seed); transformers loads it as LlamaForCausalLM.")
    init.add_argument("dir", type=path_arg, help="folder to write")
    init.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    init.add_argument("--no-vision", action="store_true", help="omit the vision encoder")
    init.add_argument("--preset", choices=("1b", "tiny"), default=None,
                      help="write a size preset instead (random bf16 weights, no vision): 1b = TinyLlama-1.1B's "
                           "shape, tiny = the same proportions, small")
    init.add_argument("--force", action="store_true", help="write into a non-empty folder")
    init.set_defaults(func=cmd_model_init)

    gen = sub.add_parser("generate", help="generate from a prompt in one process (the reference path)",
                         description="Run encode, prefill and decode in this process and stream the text.")
    add_engine_args(gen)
    text = gen.add_mutually_exclusive_group()
    text.add_argument("--prompt", default=None, help=f"completion prompt (default: {DEFAULT_PROMPT!r}); with "
                                                     "--image, the text of the chat message")
    text.add_argument("--chat", default=None, help="a user message, rendered with the model's chat template")
    gen.add_argument("--image", action="append", default=[], help="image file (PNG/JPEG) for the chat message; "
                                                                  "repeatable")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s = off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default 0)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, nondeterministic "
                                                            "when sampling)")
    gen.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="start Redis (if needed), Ray, the three pools and the HTTP API",
                         description="Start the whole stack: a local redis-server unless --redis-url is given, a "
                                     "local Ray unless --ray-address is given, each pool's replicas, and the "
                                     "OpenAI-compatible API (default http://127.0.0.1:8000). Ctrl-C stops all.")
    srv.add_argument("--config", type=path_arg, default=None, help="YAML settings file (see `epd config show`)")
    srv.add_argument("--model", type=path_arg, default=None, help="HF checkpoint folder (default: the demo model)")
    srv.add_argument("--mode", choices=("disaggregated", "colocated"), default=None,
                     help="disaggregated (default): encode, prefill and decode pools; colocated: decode-pool "
                          "workers that run whole requests in one engine (the aggregated baseline)")
    srv.add_argument("--host", default=None, help="API address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="API port (default 8000)")
    srv.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    srv.add_argument("--redis-url", default=None,
                     help="use this Redis instead of starting one. A password in it is readable by every local "
                          "user (a command line is public): give one in EPD_REDIS__URL or redis.url in --config")
    srv.set_defaults(func=cmd_serve)

    admin = ("Talks to a running `epd serve` through its admin API (--url, default http://<api.host>:<api.port> "
             "from the settings) with the admin token: EPD_API__ADMIN_TOKEN, api.admin_token in --config, or the "
             "file a local `epd serve` wrote under $EPD_STATE_DIR (default ~/.local/state/epd).")
    for name, helptext, what in (
            ("status", "pools, replicas, health, load", "Show each pool's target and ready replicas, and each "
             "worker's address, process id, state, running sequences, queued tokens and KV blocks in use."),
            ("scale", "set a pool's replica count", "Set a pool's target replica count; the pool manager starts "
             "or drains replicas to reach it (watch with `epd status`)."),
            ("drain", "stop routing to one worker", "Stop routing new work to one worker; its in-flight "
             "requests finish. A drained worker stops first on a scale-down; --undo puts it back in service.")):
        p = sub.add_parser(name, help=helptext, description=f"{what} {admin}")
        p.add_argument("--config", type=path_arg, default=None, help="YAML settings file (API address, admin token)")
        p.add_argument("--url", default=None, help="the epd API (default: http://<api.host>:<api.port>)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the admin API's JSON instead of a table")
            p.set_defaults(func=cmd_status)
        elif name == "scale":
            p.add_argument("pool", choices=("encode", "prefill", "decode"), help="the pool to scale")
            p.add_argument("replicas", type=replicas_arg, help="its new replica count (0 to 1000)")
            p.add_argument("--force", action="store_true",
                           help="scale to 0 a pool the model needs (every request then fails until it is scaled up)")
            p.set_defaults(func=cmd_scale)
        else:
            p.add_argument("worker", help="worker id, as `epd status` shows it")
            p.add_argument("--undo", action="store_true",
                           help="undo a drain: the worker takes new work again (refused while a scale-down stops it)")
            p.set_defaults(func=cmd_drain)

    config = sub.add_parser("config", help="settings").add_subparsers(dest="config_command", required=True,
                                                                     metavar="ACTION")
    show = config.add_parser("show", help="print the effective settings (secrets masked)",
                             description="Print the settings epd would run with: defaults, then --config YAML, "
                                         "then EPD_* environment variables (nested with __, e.g. "
                                         "EPD_DECODE__REPLICAS=2). Secrets are masked.")
    show.add_argument("--config", type=path_arg, default=None, help="YAML settings file")
    show.add_argument("--json", action="store_true", help="JSON instead of YAML")
    show.set_defaults(func=cmd_config_show)
    schema = config.add_parser("schema", help="print the settings' JSON schema")
    schema.set_defaults(func=cmd_config_schema)

    for register in _command_plugins():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's last flush at exit
        return rc
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_reader_left():  # another pipe (a benchmark's child): a bug, not the reader
            raise
        _silence_stdout()  # `epd config show | head -1`: stop quietly, as Python's recipe does
        return 1
    except Exception as exc:  # errors caused by input name the problem themselves; anything else is a bug
        if not isinstance(exc, _user_errors()):
            raise
        print(f"epd: error: {_one_line(exc)}", file=sys.stderr)
        return 2


# Errors a user's input or environment causes (module, class): one line and rc 2, never a traceback.
# Looked up in sys.modules, so the error path imports nothing: a class whose module is not loaded
# cannot have been raised.
_USER_ERRORS = (
    ("controlplane.cli_args", "UsageError"),
    ("workers.runtime.errors", "EngineError"),
    ("controlplane.settings", "SettingsError"),
    ("kvtransfer.policy", "PolicyError"),
    ("kvtransfer.auth", "SecurityConfigError"),
    ("controlplane.admin_client", "AdminError"),
    ("controlplane.observability.tracing", "TracingConfigError"),
    ("controlplane.state.errors", "StateUnavailable"),  # Redis unreachable (epd serve --redis-url ...)
    ("controlplane.state.errors", "RedisServerNotFound"),  # no redis-server to start a private one
    ("controlplane.pools.status", "PoolError"),  # a replica did not start (the pools are stopped again)
)


def _stdout_reader_left() -> bool:
    """Whether the process's stdout is a pipe whose reader has closed it (poll reports POLLERR)."""
    import select

    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else -1
    except (OSError, ValueError):
        return False
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's flush at exit has nowhere to fail; only for the real
    stdout (a caller that replaced sys.stdout, e.g. a test's capture, keeps its own)."""
    if sys.stdout is not sys.__stdout__:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.__stdout__.fileno())
    finally:
        os.close(devnull)


def _user_errors() -> tuple[type[Exception], ...]:
    return tuple(getattr(sys.modules[module], name) for module, name in _USER_ERRORS if module in sys.modules)


def _one_line(exc: Exception) -> str:
    """The error's first line; a pool's start failure also keeps its first replica's reason (Ray's full
    report is already on stderr, where the actor's own output went)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0]


if __name__ == "__main__":
    sys.exit(main())
