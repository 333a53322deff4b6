"""The prompts a benchmark sends: random, ShareGPT, prefix repetition, multimodal random.

Each dataset yields ``BenchRequest``s, built up front from the seed so a rerun sends the same prompts.
Lengths are in tokens. By default the server's own tokenizer counts them (``server_tokens.ServerTokens``
over its /tokenize): a random prompt is then exactly ``--input-len`` tokens as the server counts it. With
``--tokenizer`` (an HF folder or a ``tokenizer.json``) random prompts are random
token ids decoded to text, re-encoded and trimmed, so their length is exact for that tokenizer (as vLLM
does). With neither (a server without /tokenize), a prompt of N "tokens" is N common English words, one
token each in most BPE vocabularies; the server's ``usage.prompt_tokens`` then gives the real count, which
the metrics use.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.serve.config import BenchInputError, DatasetConfig

# Short, frequent words: each is a single token in GPT-2/Llama/Qwen-style BPE vocabularies.
_WORDS = ("the of and to in is for on that with as it at by from this be are or an was have not but they "
          "you all can more one time will about new there their what which when up out would so some if no "
          "other into has two its our do only over also after use how first any these may than then such "
          "each well most where many very work way even back much good before just through long made year "
          "same set part small world great place high three under last right old end day man point hand "
          "light water system data model state").split()
SHAREGPT_MAX_PROMPT = 1024  # vLLM's ShareGPT filter: prompt <= 1024 tokens, prompt + answer <= 2048, each >= 4
SHAREGPT_MAX_TOTAL = 2048
SHAREGPT_MIN_LEN = 4


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: ``text`` (plus ``image_urls`` as ``data:`` URLs for chat), the prompt length in
    tokens as far as the client knows it, and the ``max_tokens`` to ask for."""

    text: str
    prompt_len: int
    output_len: int
    image_urls: tuple[str, ...] = ()


class TextSource(Protocol):
    def text(self, rng: np.random.Generator, n_tokens: int) -> str: ...
    def count(self, text: str) -> int: ...


class WordSource:
    """Prompts of common words; ``count`` estimates tokens (about 4 characters each) for ShareGPT text."""

    def text(self, rng: np.random.Generator, n_tokens: int) -> str:
        idx = rng.integers(0, len(_WORDS), size=n_tokens)
        return " ".join(_WORDS[i] for i in idx)

    def count(self, text: str) -> int:
        return max(1, round(len(text) / 4))


class TokenizerSource:
    """Exact lengths for one tokenizer (the ``tokenizers`` library, no transformers needed)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise BenchInputError(f"--tokenizer {path}: no tokenizer.json there")
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise BenchInputError(f"--tokenizer {file}: cannot load it ({exc})") from None
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        # tokens that decode to clean text on their own (no lone UTF-8 bytes), so round trips stay close
        ids = [i for s, i in self.tok.get_vocab().items() if s not in special]
        clean = [i for i in ids if (t := self.tok.decode([i])).strip() and "\ufffd" not in t]
        self.ids = np.array(sorted(clean), dtype=np.int64)
        if self.ids.size == 0:
            raise BenchInputError(f"--tokenizer {file}: no usable tokens in its vocabulary")

    def text(self, rng: np.random.Generator, n_tokens: int) -> str:
        """Random tokens decoded to text whose re-encoding is ``n_tokens`` long (a few passes: decoding then
        encoding may merge or split tokens; the result can end up a token or two off, never more than the
        last pass's correction)."""
        text = self.tok.decode(rng.choice(self.ids, size=n_tokens).tolist())
        for _ in range(4):
            again = self.tok.encode(text, add_special_tokens=False).ids
            if len(again) == n_tokens:
                break
            if len(again) > n_tokens:
                text = self.tok.decode(again[:n_tokens])
            else:
                text = self.tok.decode(again + rng.choice(self.ids, size=n_tokens - len(again)).tolist())
        return text

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(cfg: DatasetConfig, src: TextSource, rng: np.random.Generator, text_rng: np.random.Generator,
                    point: int) -> list[BenchRequest]:
    ins = _lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    outs = _lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    return [BenchRequest(src.text(text_rng, i), i, o) for i, o in zip(ins, outs)]


def prefix_requests(cfg: DatasetConfig, src: TextSource, rng: np.random.Generator, text_rng: np.random.Generator,
                    point: int) -> list[BenchRequest]:
    """``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each request one of them (round robin, then
    shuffled) plus a unique suffix of about ``input_len`` tokens: the prefix-cache and routing workload."""
    suffix_lens = _lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    outs = _lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    order = rng.permutation(cfg.num_prompts).tolist()
    prefixes = [src.text(text_rng, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    return [BenchRequest(prefixes[k % cfg.num_prefixes] + " " + src.text(text_rng, suffix_lens[k]),
                         cfg.prefix_len + suffix_lens[k], outs[k]) for k in order]


def png_data_url(rng: np.random.Generator, width: int, height: int) -> str:
    """A random-noise RGB PNG as a ``data:`` URL (noise, so no image compresses to nothing)."""
    from PIL import Image

    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def multimodal_requests(cfg: DatasetConfig, src: TextSource, rng: np.random.Generator,
                        text_rng: np.random.Generator, point: int) -> list[BenchRequest]:
    """Random text plus ``images_per_request`` generated PNGs, sizes cycling through ``image_sizes``.
    ``prompt_len`` counts the text only; the server's usage adds the image tokens."""
    base = random_requests(cfg, src, rng, text_rng, point)
    out = []
    for k, req in enumerate(base):
        sizes = [cfg.image_sizes[(k * cfg.images_per_request + j) % len(cfg.image_sizes)]
                 for j in range(cfg.images_per_request)]
        out.append(BenchRequest(req.text, req.prompt_len, req.output_len,
                                tuple(png_data_url(text_rng, w, h) for w, h in sizes)))
    return out


def _turn_text(turn: Any, where: str) -> str:
    if not isinstance(turn, dict):
        raise BenchInputError(f"{where}: a turn must be an object with \"value\" (or \"content\"), "
                              f"got {type(turn).__name__}")
    text = turn.get("value", turn.get("content"))
    if not isinstance(text, str):
        raise BenchInputError(f"{where}: a turn needs a string \"value\" (or \"content\")")
    return text


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(prompt, reference answer) of every conversation with at least two turns. Accepts ShareGPT's
    ``{"conversations": [{"from", "value"}, ...]}`` and the ``{"messages": [{"role", "content"}]}`` variant."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchInputError(f"cannot read dataset file {path}: {exc}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BenchInputError(f"malformed dataset file {path}: not valid JSON ({exc.msg} at line {exc.lineno} "
                              f"column {exc.colno})") from None
    if not isinstance(data, list):
        raise BenchInputError(f"malformed dataset file {path}: expected a JSON list of conversations, "
                              f"got a {type(data).__name__}")
    pairs = []
    for i, entry in enumerate(data):
        where = f"malformed dataset file {path}: entry {i}"
        turns = entry.get("conversations", entry.get("messages")) if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise BenchInputError(f"{where}: expected an object with a \"conversations\" list")
        if len(turns) >= 2:
            pairs.append((_turn_text(turns[0], where), _turn_text(turns[1], where)))
    if not pairs:
        raise BenchInputError(f"dataset file {path} holds no conversation with at least two turns")
    return pairs


def sharegpt_requests(cfg: DatasetConfig, src: TextSource, rng: np.random.Generator, text_rng: np.random.Generator,
                      point: int) -> list[BenchRequest]:
    """Conversations in a seeded order; load point k takes the k-th ``num_prompts`` of them (cycling when the
    file is short)."""
    assert cfg.path is not None
    usable = []
    for prompt, answer in load_sharegpt(cfg.path):
        p = src.count(prompt)
        o = cfg.sharegpt_output_len or src.count(answer)
        if p < SHAREGPT_MIN_LEN or o < SHAREGPT_MIN_LEN or p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL:
            continue
        usable.append(BenchRequest(prompt, p, o))
    if not usable:
        raise BenchInputError(f"dataset file {cfg.path}: no conversation fits vLLM's ShareGPT filter (prompt and "
                              f"answer >= {SHAREGPT_MIN_LEN} tokens, prompt <= {SHAREGPT_MAX_PROMPT}, "
                              f"total <= {SHAREGPT_MAX_TOTAL})")
    order = rng.permutation(len(usable)).tolist()
    first = point * cfg.num_prompts
    return [usable[order[(first + k) % len(order)]] for k in range(cfg.num_prompts)]


_BUILDERS = {"random": random_requests, "prefix": prefix_requests, "multimodal": multimodal_requests,
             "sharegpt": sharegpt_requests}


def build_requests(cfg: DatasetConfig, seed: int, src: TextSource | None = None, point: int = 0) -> list[BenchRequest]:
    """``cfg.num_prompts`` requests, deterministic in ``seed`` (and the source's tokenizer). ``src``: where
    prompt text and lengths come from (default: ``--tokenizer``'s, else common words). ``point``: which load
    point of a sweep they are for: every point gets the same lengths (the same draws from ``seed``) and text
    (and images) of its own, so a server with a prefix cache cannot answer a later point from an earlier
    one's prompts; ShareGPT's points take successive conversations. Raises BenchInputError on bad input."""
    cfg.validate()
    if src is None:
        src = TokenizerSource(cfg.tokenizer) if cfg.tokenizer is not None else WordSource()
    rng = np.random.default_rng(seed)
    text_rng = rng if point == 0 else np.random.default_rng([seed, point])  # point 0: one generator for all
    return _BUILDERS[cfg.name](cfg, src, rng, text_rng, point)

