"""A briefly trained checkpoint of the demo model's shape, for accuracy figures that a random-weight model
cannot give.

The built-in demo model has random weights: its next-token distributions are nearly flat, so a
quantisation error far below any trained model's margins flips greedy choices, and every flip changes
the rest of the sequence. ``epd bench kv-accuracy`` on it measures that more than the codecs. This trains
the same architecture and tokenizer from a fresh initialisation on text that is on every machine (the
Python standard library's sources), on the CPU, for a fixed number of minutes, and writes an ordinary HF
checkpoint folder that ``--model`` accepts:

    python -m bench.train_checkpoint DIR [--minutes 10] [--seed 0]
    .venv/bin/epd bench kv-accuracy --model DIR

It is a small model trained for minutes, not a language model anyone would serve; its use is a model
whose greedy choices are not near-ties. Needs ``transformers`` (a dev dependency). The final training
loss is printed and written to DIR/training.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from controlplane.cli_args import path_arg

SEQ_LEN = 256
BATCH = 8


def corpus_files() -> list[Path]:
    """The standard library's .py files, in a fixed order (the same text on every CPython 3.11)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def token_stream(tokenizer: Any, limit_tokens: int) -> list[int]:  # a tokenizers.Tokenizer (untyped)
    ids: list[int] = []
    for path in corpus_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids.extend(tokenizer.encode(text).ids)
        if len(ids) >= limit_tokens:
            break
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=path_arg, help="where to write the checkpoint folder (must be empty or absent)")
    parser.add_argument("--minutes", type=float, default=10.0, help="training time (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--corpus-tokens", type=int, default=20_000_000,
                        help="tokenize at most this much of the corpus (default 20M: all of it)")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be positive")
    if args.corpus_tokens < 2 * SEQ_LEN:
        parser.error(f"--corpus-tokens must be at least {2 * SEQ_LEN}")
    if args.dir.exists() and any(args.dir.iterdir()):
        parser.error(f"{args.dir} is not empty")
    try:
        import torch
        from tokenizers import Tokenizer
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        print(f"train_checkpoint needs transformers (the bench extra: pip install transformers): {exc}",
              file=sys.stderr)
        return 2

    from workers.runtime.default_model import ensure_default_checkpoint

    demo = ensure_default_checkpoint()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = LlamaConfig.from_pretrained(demo)
    model = LlamaForCausalLM(config)  # a fresh initialisation, not the demo's random weights
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    ids = torch.tensor(token_stream(tokenizer, args.corpus_tokens)[:args.corpus_tokens], dtype=torch.long)
    windows = (ids.numel() - 1) // SEQ_LEN
    print(f"corpus: {ids.numel():,} tokens from the standard library; {windows:,} windows of {SEQ_LEN}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    step, losses = 0, []
    model.train()
    while time.monotonic() < deadline:
        starts = torch.randint(0, windows, (BATCH,), generator=gen) * SEQ_LEN
        batch = torch.stack([ids[s:s + SEQ_LEN] for s in starts.tolist()])
        lr = 1e-3 * min(1.0, (step + 1) / 50)  # warm-up, then constant
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        if step % 25 == 0:
            recent = sum(losses[-25:]) / 25
            print(f"step {step}: loss {recent:.3f} (perplexity {math.exp(recent):.1f})", flush=True)
    final = sum(losses[-25:]) / max(1, len(losses[-25:]))
    args.dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (demo / name).exists():
            shutil.copy(demo / name, args.dir / name)
    (args.dir / "training.json").write_text(json.dumps({
        "steps": step, "tokens_seen": step * BATCH * SEQ_LEN, "final_loss": final, "minutes": args.minutes,
        "seed": args.seed, "corpus": "CPython standard library sources", "from": "fresh init, demo architecture"},
        indent=2))
    print(f"wrote {args.dir}: {step} steps, {step * BATCH * SEQ_LEN:,} tokens, final loss {final:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
