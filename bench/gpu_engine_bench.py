"""``epd bench engine --device cuda``: the engine on a GPU beside transformers on the same GPU.

Same checkpoint, dtype and GPU, same run; every timer is bracketed by ``torch.cuda.synchronize``.
On a CPU device the same flow runs (no figure of it is meaningful): that is how its test checks it.
Figures (each the best of ``--repeats``):
  roofline  weight bytes a decode step reads (every parameter but the embedding table, which is only
            gathered from) over the device's copy rate measured here (a device-to-device copy moves
            each byte twice, read and write: that bus rate is the one a weight read runs at);
  decode    aggregate tokens/s at each ``--batches`` size (prefill excluded), vs transformers
            ``generate()`` at the same batch (its one-token run subtracted the same way); batch 1
            is also shown as a share of the roofline;
  sampled   the same at the largest batch with ``bench.sampled``'s temperature and top_p, vs
            transformers sampling with them at that batch;
  prefill   prompt tokens/s of one ``--prefill-lengths`` prompt, vs one transformers forward;
and the KV pool's size, peak GPU memory and the CUDA graphs' capture time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench.sampled import decode_params, hf_sampling
from workers.runtime.devices import resolve_device
from workers.runtime.engine import DTYPES, Engine, EngineConfig
from workers.runtime.loader import load_model
from workers.runtime.sampler import SamplingParams

PROMPT_TOKENS = 32


@dataclass
class GpuRow:
    name: str
    epd_tok_s: float
    ref_name: str
    ref_tok_s: float | None

    @property
    def ratio(self) -> float | None:
        return self.epd_tok_s / self.ref_tok_s if self.ref_tok_s else None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA device; a CPU's work is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes, with the device's work before and after it synchronised."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def copy_rate(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    """Bytes/s a device-to-device copy of ``nbytes`` moves one way (the bus carries twice this)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    secs = _best(lambda: timed(lambda: dst.copy_(src), device), repeats)
    return nbytes / secs  # src and dst go with this frame; the caller empties the cache


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters one decode step reads: all of them, once, but the embedding table
    (unless tied to the LM head, which reads it whole)."""
    embed = model.embed_tokens.weight  # type: ignore[union-attr]  # nn.Module attributes are Tensor | Module
    lm_head = model.lm_head.weight  # type: ignore[union-attr]  # nn.Module attributes are Tensor | Module
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (p is embed and p is not lm_head):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def _prompt(length: int, vocab: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1234 + salt)
    return torch.randint(10, min(vocab, 2000), (length,), generator=g).tolist()


def engine_decode_rate(engine: Engine, vocab: int, batch: int, tokens: int, sampled: bool = False) -> float:
    """Decode tokens/s of ``batch`` sequences of ``tokens`` tokens each, prefill not timed. Counted as they come
    out: when the prompts take more than one step to admit, the first ones are a few tokens ahead."""
    for i in range(batch):
        engine.add_request(f"d{i}", _prompt(PROMPT_TOKENS, vocab, i), decode_params(tokens, sampled, i))
    while engine.stats().num_waiting or any(s.num_computed < len(s.prompt_ids) for s in engine.scheduler.running):
        engine.step()
    produced = 0

    def decode() -> None:
        nonlocal produced
        while engine.has_unfinished():
            produced += sum(len(o.new_token_ids) for o in engine.step())
    secs = timed(decode, torch.device(engine.config.device))
    assert batch <= produced <= batch * (tokens - 1), f"{produced} tokens from {batch} sequences"
    return produced / secs


def _engine_prefill_seconds(engine: Engine, vocab: int, length: int) -> float:
    engine.add_request("p", _prompt(length, vocab), SamplingParams(max_tokens=1, temperature=0.0))

    def prefill() -> None:
        while engine.has_unfinished():
            engine.step()
    return timed(prefill, torch.device(engine.config.device))


@torch.inference_mode()
def _hf_generate_seconds(hf: Any, batch: int, new_tokens: int, vocab: int,
                         sampled: bool = False) -> float:  # hf: a transformers model
    ids = torch.tensor([_prompt(PROMPT_TOKENS, vocab, i) for i in range(batch)], device=hf.device)
    return timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, pad_token_id=0, **hf_sampling(sampled)),
                 hf.device)


@torch.inference_mode()
def _hf_forward_seconds(hf: Any, length: int, vocab: int) -> float:  # hf: a transformers model
    ids = torch.tensor([_prompt(length, vocab)], device=hf.device)
    return timed(lambda: hf(ids, use_cache=False, logits_to_keep=1), hf.device)


def run_cuda(args: argparse.Namespace, batches: list[int], lengths: list[int]) -> int:
    """The GPU benchmark; arguments already checked by ``engine_bench.run``."""
    from bench.hf_reference import load_hf_model
    from controlplane.cli_args import UsageError, model_dir

    device = resolve_device(args.device)  # set_device needs the index
    cuda = device.type == "cuda"  # else the flow's test on CPU: a small copy, no GPU memory figures
    if cuda:
        torch.cuda.set_device(device)
    path = model_dir(args.model)
    dtype = DTYPES[args.dtype]
    tokens, repeats = args.decode_tokens, args.repeats
    rate = copy_rate(device, 2**30 if cuda else 2**24)
    if cuda:
        torch.cuda.empty_cache()
    bundle = load_model(path, dtype=dtype, device=args.device, with_vision=False)
    vocab = bundle.config.vocab_size
    context = bundle.config.max_position_embeddings
    if max(lengths) >= context or PROMPT_TOKENS + tokens > context:
        raise UsageError(f"--prefill-lengths {max(lengths)} / --decode-tokens {tokens}: this model's context is "
                         f"{context} tokens (a prompt plus its output must fit)")
    weights = decode_weight_bytes(bundle.model)
    roofline = 2 * rate / weights
    hf = None if args.no_hf else load_hf_model(path, dtype).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    cfg = EngineConfig(dtype=args.dtype, device=args.device, max_num_seqs=max(batches),
                       max_num_batched_tokens=max(max(lengths), max(batches)), prefill_chunk_size=max(lengths),
                       gpu_memory_utilization=0.8, prefix_caching=False)  # repeats send one prompt: compute it all
    engine = Engine(bundle.model, None, cfg, bundle.eos_token_ids)
    capture = engine.graphs.capture_seconds if engine.graphs is not None else 0.0
    ref_failed: list[str] = []

    def reference(fn: Callable[[], float]) -> float | None:
        """A transformers figure, or None once one has failed: the engine's figures are still printed."""
        if hf is None or ref_failed:
            return None
        try:
            return fn()
        except Exception as exc:  # a failing reference (out of memory, an API change) must not lose the run
            ref_failed.append(repr(exc))
            return None

    engine_decode_rate(engine, vocab, 1, 4)  # warm-up: allocator, lazy inits
    _engine_prefill_seconds(engine, vocab, min(lengths))
    reference(lambda: _hf_generate_seconds(hf, 1, 4, vocab))

    def hf_decode(b: int, sampled: bool = False) -> float:
        full = _best(lambda: _hf_generate_seconds(hf, b, tokens, vocab, sampled), repeats)
        first = _best(lambda: _hf_generate_seconds(hf, b, 1, vocab, sampled), repeats)
        return b * (tokens - 1) / max(full - first, 1e-9)

    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    # Each row prints as soon as it is measured (flushed): a run stopped at a time limit keeps what it took.
    print(f"model {path.name}: {sum(p.numel() for p in bundle.model.parameters()) / 1e6:.1f}M params, "
          f"{args.dtype}, {device_name}, torch {torch.__version__}")
    print(f"device copy {rate / 1e9:.0f} GB/s one way ({2 * rate / 1e9:.0f} GB/s read+write); decode reads "
          f"{weights / 1e9:.2f} GB of weights a step: roofline {roofline:.0f} tok/s at batch 1")
    print(f"{'figure':<22}{'epd tok/s':>12}  {'reference':<24}{'ref tok/s':>12}{'ratio':>9}", flush=True)
    rows: list[GpuRow] = []

    def add(r: GpuRow) -> None:
        rows.append(r)
        ref_s = f"{r.ref_tok_s:12.1f}" if r.ref_tok_s else f"{'-':>12}"
        ratio = f"{r.ratio:8.2f}x" if r.ratio else f"{'-':>9}"
        print(f"{r.name:<22}{r.epd_tok_s:12.1f}  {r.ref_name:<24}{ref_s}{ratio}", flush=True)

    for b in batches:
        tok_s = max(engine_decode_rate(engine, vocab, b, tokens) for _ in range(repeats))
        add(GpuRow(f"decode batch {b}", tok_s, f"HF generate batch {b}",
                   reference(lambda: hf_decode(b))))
    b = max(batches)
    tok_s = max(engine_decode_rate(engine, vocab, b, tokens, sampled=True) for _ in range(repeats))
    add(GpuRow(f"sampled batch {b}", tok_s, f"HF sampled batch {b}",
               reference(lambda: hf_decode(b, sampled=True))))
    for n in lengths:
        secs = _best(lambda: _engine_prefill_seconds(engine, vocab, n), repeats)
        add(GpuRow(f"prefill {n} tokens", n / secs, f"HF forward {n} tokens",
                   reference(lambda: n / _best(lambda: _hf_forward_seconds(hf, n, vocab), repeats))))
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    graphs = _graphs_line(engine, capture)
    shares = {r.name: r.epd_tok_s / roofline for r in rows if r.name == "decode batch 1"}
    hf1 = next((r.ref_tok_s for r in rows if r.name == "decode batch 1" and r.ref_tok_s), None)
    if shares:
        hf_share = f"; transformers {hf1 / roofline:.1%}" if hf1 else ""
        print(f"decode batch 1 at {shares['decode batch 1']:.1%} of the roofline{hf_share}")
        breakdown = step_breakdown(engine, vocab, tokens, roofline)
        if breakdown:
            print(breakdown)
    print(f"KV pool {engine.cache.nbytes / 2**30:.2f} GiB ({engine.cache.num_blocks} blocks of "
          f"{engine.cache.block_size} tokens); peak GPU memory {peak / 2**30:.2f} GiB (the process: transformers "
          f"too); CUDA graphs "
          f"{graphs}")
    for line in ref_failed:
        print(f"FAILED the transformers reference: {line} (the rows after it have none)")
    if args.json:
        meta = {"model": str(path), "dtype": args.dtype, "device": device_name,
                "torch": torch.__version__, "copy_bytes_per_s": rate, "decode_weight_bytes": weights,
                "roofline_tok_s": roofline, "kv_pool_bytes": engine.cache.nbytes, "peak_gpu_bytes": peak,
                "graph_capture_s": capture, "graphs": graphs, "decode_tokens": tokens,
                "repeats": repeats, "reference_failed": ref_failed}
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]},
                                        indent=2))
    return 1 if ref_failed else 0


def step_breakdown(engine: Engine, vocab: int, tokens: int, roofline: float) -> str | None:
    """One more batch-1 decode run, its graph replays timed on the GPU: how much of a step is the graph (the
    kernels) and how much the rest (scheduling, staging the inputs, sampling, reading the token back). None
    without captured graphs (a CPU run, graphs off, a failed capture)."""
    graphs = engine.graphs
    if graphs is None or graphs.capture_error is not None:
        return None
    graphs.replay_events = []
    try:
        step_s = 1.0 / engine_decode_rate(engine, vocab, 1, tokens)
        graph_s = graphs.replay_seconds()
    except Exception as exc:  # a diagnostic: it must not lose the figures already printed
        return f"batch-1 step breakdown unavailable: {exc!r}"
    finally:
        graphs.replay_events = None
    if graph_s is None:
        return "batch-1 step breakdown unavailable: no decode step replayed a graph"
    return (f"batch-1 step {step_s * 1e6:.0f} us: its graph {graph_s * 1e6:.0f} us on the GPU ("
            f"{1.0 / roofline / graph_s:.1%} of the roofline), {max(step_s - graph_s, 0.0) * 1e6:.0f} us outside "
            f"it (scheduling, staging, sampling)")


def _graphs_line(engine: Engine, capture_s: float) -> str:
    """What the engine's CUDA graphs are: off, captured (how many, how long), or failed (why: steps ran eager)."""
    if engine.graphs is None:
        return "off"
    if engine.graphs.capture_error is not None:
        return f"capture FAILED, every step ran eager ({engine.graphs.capture_error})"
    return f"{len(engine.graphs.buckets)} buckets captured in {capture_s:.2f} s"
