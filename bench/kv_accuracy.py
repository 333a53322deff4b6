"""Token agreement of quantised KV transfer against the bf16 transfer, end to end.

Each prompt is prefilled, its KV sent through the real transfer (gRPC on loopback) with the codec
policy under test, and decoded greedily. Two figures per policy:
  free-running   share of the 64 x 64 output positions whose token equals the bf16 path's; one
                 flipped near-tie changes every later position, so this is the strict figure;
  teacher-forced share of decode steps whose argmax equals the bf16 path's token when both are fed
                 the bf16 path's tokens: how often the codec changes a decision, without cascades.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from kvtransfer.policy import ExplicitPolicy, parse_policy
from workers.disagg_pair import DisaggPair, PairResult
from workers.runtime.loader import LoadedModel
from workers.runtime.sampler import SamplingParams

_WORDS = ("the model reads a checkpoint folder serving prefill decode cache block token image request worker "
          "pool stream layer scale quick brown fox jumps over lazy dog").split()


@dataclass(frozen=True)
class Agreement:
    policy: str
    codecs: tuple[str, ...]
    free_running: float
    teacher_forced: float
    diverged: int  # sequences whose free-running output differs anywhere


def sample_prompts(bundle: LoadedModel, n: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    assert bundle.tokenizer is not None
    return [bundle.tokenizer.encode(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 120))))
            for _ in range(n)]


def run(args: argparse.Namespace) -> int:
    """``epd bench kv-accuracy``."""
    import torch

    from controlplane.cli_args import UsageError, check_engine_args, check_positive, model_dir
    from kvtransfer.policy import ExplicitPolicy, PolicyError
    from workers.prefill.calibrate import resolve_codecs
    from workers.runtime.engine import DTYPES, Engine, EngineConfig
    from workers.runtime.loader import load_model

    check_engine_args(args)  # every argument before any loading or output
    check_positive(args, "--prompts", "--max-tokens")
    policies = args.policy or ["fp8", "int8", "int4", "int4,0=bf16,-1=bf16", "auto"]
    try:
        parsed = [parse_policy(spec) for spec in policies]
    except PolicyError as exc:
        raise UsageError(f"--policy: {exc}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_model(model_dir(args.model), dtype=DTYPES[args.dtype], device=args.device, with_vision=False)
    for spec, policy in zip(policies, parsed):
        if isinstance(policy, ExplicitPolicy):
            try:
                policy.resolve(bundle.config.num_layers)
            except PolicyError as exc:
                raise UsageError(f"--policy {spec!r}: {exc}") from None
    prompts = sample_prompts(bundle, args.prompts)
    explicit, labels = [], []
    for spec in policies:
        label = spec
        if spec.startswith("auto"):
            engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(dtype=args.dtype))
            codecs = resolve_codecs(spec, engine, sample_prompts(bundle, 8, seed=99)).codecs
            resolved = ",".join([codecs[0]] + [f"{i}={c}" for i, c in enumerate(codecs) if c != codecs[0]])
            print(f"{spec} resolved to {resolved}")
            spec, label = resolved, f"{spec} (resolved to {resolved})"
        explicit.append(spec)
        labels.append(label)
    print(f"{args.prompts} prompts x {args.max_tokens} greedy tokens, agreement with the bf16 transfer")
    print(f"{'policy':<28}{'free-running':>14}{'teacher-forced':>16}{'diverged':>10}")
    for label, a in zip(labels, agreement(bundle, explicit, prompts, args.max_tokens)):
        print(f"{label:<28}{a.free_running:14.4f}{a.teacher_forced:16.4f}{a.diverged:>6}/{len(prompts)}")
    return 0


def agreement(bundle: LoadedModel, policies: list[str], prompts: list[list[int]],
              max_tokens: int = 64) -> list[Agreement]:
    layers = bundle.config.num_layers
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref = [r.token_ids for r in _run_pair(bundle, ("bf16",) * layers, prompts, [greedy] * len(prompts))]
    forced = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_logits=True,
                             forced_tokens=tuple(r)) for r in ref]
    total = len(prompts) * max_tokens
    out = []
    for spec in policies:
        policy = parse_policy(spec)
        assert isinstance(policy, ExplicitPolicy), "agreement() takes explicit policies; resolve auto first"
        codecs = policy.resolve(layers)
        free = [r.token_ids for r in _run_pair(bundle, codecs, prompts, [greedy] * len(prompts))]
        tf = _run_pair(bundle, codecs, prompts, forced)
        same = sum(a == b for x, y in zip(ref, free) for a, b in zip(x, y))
        # step 0 is prefill's own token (not affected by the transfer); steps 1.. are decode decisions
        decisions = sum(len(r) - 1 for r in ref)
        hits = sum(int(logits.argmax()) == tok for res, r in zip(tf, ref)
                   for logits, tok in zip(res.logits[1:], r[1:]))
        diverged = sum(x != y for x, y in zip(ref, free))
        out.append(Agreement(spec, codecs, same / total, hits / decisions, diverged))
    return out


def _run_pair(bundle: LoadedModel, codecs: tuple[str, ...], prompts: list[list[int]],
              params: list[SamplingParams]) -> list[PairResult]:
    with DisaggPair(bundle, codecs) as pair:
        return pair.run(prompts, params)
