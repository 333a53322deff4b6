"""``epd bench engine``: the engine's prefill and decode throughput beside HF transformers.

Same checkpoint, same dtype, same thread count, same process, same run. Figures:
  decode   aggregate tokens/s at each batch size (prefill excluded), vs transformers ``generate()``
           at batch 1 (its prefill subtracted the same way);
  sampled  the same at the largest batch with temperature 0.8 and top_p 0.95 (``bench.sampled``), vs
           transformers sampling with them at batch 1;
  prefill  prompt tokens/s for one prompt, vs one transformers forward over the same tokens;
  prefix   prompt tokens/s for the longest prompt when all but its last ``PREFIX_TAIL`` tokens were cached
           by an earlier request, vs the same two requests on an engine with the prefix cache off.
Each figure is the best of ``--repeats`` runs. Peak RSS and the KV pool's bytes against its budget
are reported too.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from bench.gpu_engine_bench import engine_decode_rate
from bench.hf_reference import load_hf_model
from bench.sampled import hf_sampling
from workers.runtime.engine import DEFAULT_KV_CACHE_BYTES, DTYPES, Engine, EngineConfig
from workers.runtime.loader import LoadedModel, load_model
from workers.runtime.sampler import SamplingParams

PREFIX_TAIL = 128  # the prefix figure's uncached tokens: a user turn after a shared system prompt


@dataclass
class Row:
    name: str
    epd_tok_s: float
    ref_name: str
    ref_tok_s: float | None

    @property
    def ratio(self) -> float | None:
        return self.epd_tok_s / self.ref_tok_s if self.ref_tok_s else None


def _best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def _prompt(length: int, vocab: int, salt: int = 0) -> list[int]:
    # Fixed pseudo-random ids (no special tokens needed): ignore_eos keeps lengths exact.
    g = torch.Generator().manual_seed(1234 + salt)
    return torch.randint(10, vocab, (length,), generator=g).tolist()


def _engine_decode_rate(bundle: LoadedModel, cfg: EngineConfig, batch: int, tokens: int,
                        sampled: bool = False) -> float:
    """``engine_decode_rate`` on a fresh engine, which must end with every block free."""
    engine = Engine(bundle.model, bundle.tokenizer, cfg, bundle.eos_token_ids)
    rate = engine_decode_rate(engine, bundle.config.vocab_size, batch, tokens, sampled)
    assert engine.cache.allocator.num_free == engine.cache.num_blocks
    return rate


def _engine_prefill_seconds(bundle: LoadedModel, cfg: EngineConfig, length: int, cached: int = 0) -> float:
    """Seconds to prefill a ``length``-token prompt on a fresh engine; ``cached`` > 0: after another request
    (untimed) with the same first ``cached`` tokens and a different rest."""
    engine = Engine(bundle.model, bundle.tokenizer, cfg, bundle.eos_token_ids)
    prompt = _prompt(length, bundle.config.vocab_size)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    if cached:
        engine.add_request("earlier", prompt[:cached] + _prompt(length - cached, bundle.config.vocab_size, 1), one)
        while engine.has_unfinished():
            engine.step()
    engine.add_request("p", prompt, one)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


@torch.inference_mode()
def _hf_generate_seconds(hf: Any, prompt: list[int], new_tokens: int,
                         sampled: bool = False) -> float:  # hf: a transformers model
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=0, **hf_sampling(sampled))
    return time.perf_counter() - start


@torch.inference_mode()
def _hf_forward_seconds(hf: Any, length: int, vocab: int) -> float:  # hf: a transformers model
    ids = torch.tensor([_prompt(length, vocab)])
    start = time.perf_counter()
    hf(ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    from controlplane.cli_args import check_engine_args, check_positive, int_list, model_dir

    check_engine_args(args)  # every argument before any loading
    cuda = torch.device(args.device).type == "cuda"
    batches = int_list(args.batches or ("1,128" if cuda else "1,8,16,32"), "--batches")
    lengths = int_list(args.prefill_lengths or ("2048" if cuda else "128,1024,4096"), "--prefill-lengths")
    check_positive(args, "--decode-tokens", "--repeats")
    if cuda:
        from bench.gpu_engine_bench import run_cuda
        return run_cuda(args, batches, lengths)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    dtype = DTYPES[args.dtype]
    bundle = load_model(path, dtype=dtype, device=args.device, with_vision=False)
    cfg = EngineConfig(dtype=args.dtype, device=args.device, max_num_seqs=max(64, max(batches)))
    tokens = args.decode_tokens
    hf = None if args.no_hf else load_hf_model(path, dtype)

    # warm both up once (allocator, thread pool, lazy inits)
    _engine_decode_rate(bundle, cfg, 1, 4)
    if hf is not None:
        _hf_generate_seconds(hf, _prompt(32, bundle.config.vocab_size), 4)

    rows: list[Row] = []

    def hf_decode(sampled: bool) -> float | None:
        if hf is None:
            return None
        prompt = _prompt(32, bundle.config.vocab_size)
        full = _best(lambda: _hf_generate_seconds(hf, prompt, tokens, sampled), args.repeats)
        first = _best(lambda: _hf_generate_seconds(hf, prompt, 1, sampled), args.repeats)
        return (tokens - 1) / max(full - first, 1e-9)
    greedy_ref = hf_decode(False)
    for b in batches:
        rate = max(_engine_decode_rate(bundle, cfg, b, tokens) for _ in range(args.repeats))
        rows.append(Row(f"decode batch {b}", rate, "HF generate batch 1", greedy_ref))
    b = max(batches)
    rate = max(_engine_decode_rate(bundle, cfg, b, tokens, sampled=True) for _ in range(args.repeats))
    rows.append(Row(f"sampled batch {b}", rate, "HF sampled batch 1", hf_decode(True)))
    for n in lengths:
        secs = _best(lambda: _engine_prefill_seconds(bundle, cfg, n), args.repeats)
        ref = None
        if hf is not None:
            ref = n / _best(lambda: _hf_forward_seconds(hf, n, bundle.config.vocab_size), args.repeats)
        rows.append(Row(f"prefill {n} tokens", n / secs, f"HF forward {n} tokens", ref))
    n = max(lengths)
    if n > PREFIX_TAIL:
        cached = n - PREFIX_TAIL
        hit = _best(lambda: _engine_prefill_seconds(bundle, cfg, n, cached), args.repeats)
        cold = _best(lambda: _engine_prefill_seconds(bundle, replace(cfg, prefix_caching=False), n, cached),
                     args.repeats)
        rows.append(Row(f"prefix {n} ({cached} hit)", n / hit, f"epd {n}, prefix cache off", n / cold))

    probe = Engine(bundle.model, None, cfg)
    budget = cfg.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    meta = {"model": str(path), "params": sum(p.numel() for p in bundle.model.parameters()),
            "dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "decode_tokens": tokens, "repeats": args.repeats, "kv_pool_bytes": probe.cache.nbytes,
            "kv_budget_bytes": budget, "peak_rss_bytes": peak_rss}
    print(f"model {path.name}: {meta['params'] / 1e6:.1f}M params, {args.dtype}, {meta['threads']} threads, "
          f"torch {torch.__version__}")
    print(f"{'figure':<24}{'epd tok/s':>12}  {'reference':<28}{'ref tok/s':>12}{'ratio':>9}")
    for r in rows:
        ref_s = f"{r.ref_tok_s:12.1f}" if r.ref_tok_s else f"{'-':>12}"
        ratio = f"{r.ratio:8.2f}x" if r.ratio else f"{'-':>9}"
        print(f"{r.name:<24}{r.epd_tok_s:12.1f}  {r.ref_name:<28}{ref_s}{ratio}")
    print(f"KV pool {probe.cache.nbytes / 2**20:.1f} MiB of a {budget / 2**20:.0f} MiB budget; "
          f"peak RSS {peak_rss / 2**20:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]},
                                        indent=2))
    return 0
