"""Tokenizer (HF ``tokenizer.json`` via the ``tokenizers`` package), chat templates, and an
incremental detokenizer that applies stop strings.

The chat template is rendered the way transformers renders it: a sandboxed jinja2 environment
with ``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and ``tojson``, and the special tokens
as variables. The template comes from ``chat_template.jinja`` when present (where recent
transformers versions write it), else from ``tokenizer_config.json``, else from a processor's
``chat_template.json`` (where LLaVA checkpoints on the Hub keep it).

A rendered chat is tokenised as transformers tokenises it: a tokenizer's ``apply_chat_template`` adds no
special tokens (the template writes them); a multimodal processor's (a folder with ``processor_config.json``
or ``preprocessor_config.json``, as LLaVA's) adds them unless the text already starts with the BOS token.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from workers.runtime.config import read_json_object, read_text
from workers.runtime.errors import CheckpointError, InvalidRequestError

Message = dict[str, Any]


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value if isinstance(value, str) else None


RELEASE_GIL_CHARS = 16 * 1024  # texts this long or longer are tokenised with the GIL released
RELEASE_GIL_IDS = 4096  # id lists this long or longer are decoded with the GIL released


class Tokenizer:
    def __init__(self, backend: HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, image_token: str | None = None,
                 processor_chat: bool = False) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.image_token = image_token
        self.processor_chat = processor_chat  # tokenise chats as a transformers processor does (module doc)
        self._template: jinja2.Template | None = None
        self._parts: bool | None = None  # whether the template loops over a message's content parts

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """Read the tokenizer files and compile the chat template; any problem names its file."""
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: is not a folder")
        path = folder / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{folder}: tokenizer.json not found (only fast tokenizers are supported)")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise CheckpointError(f"{path}: unreadable tokenizer ({exc})") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.exists():
            config = read_json_object(config_path)
        template = None
        jinja_path, processor_path = folder / "chat_template.jinja", folder / "chat_template.json"
        if jinja_path.exists():
            template, template_path = read_text(jinja_path), jinja_path
        else:
            template, template_path = _config_template(config.get("chat_template"), config_path), config_path
        if template is None and processor_path.exists():  # a processor's template (LLaVA on the Hub)
            template = _config_template(read_json_object(processor_path).get("chat_template"), processor_path)
            template_path = processor_path
        tok = cls(backend, bos_token=_token_str(config.get("bos_token")),
                  eos_token=_token_str(config.get("eos_token")), chat_template=template,
                  image_token=_token_str(config.get("image_token")),
                  processor_chat=any((folder / f).exists() for f in ("processor_config.json",
                                                                     "preprocessor_config.json")))
        if template:
            tok._template = _compile_template(template, template_path)  # at load, not at the first chat request
        return tok

    # ------------------------------------------------------------------ basics
    @functools.cached_property
    def vocab_size(self) -> int:
        """One past the highest token id the tokenizer can produce: its vocabulary, added tokens and the
        special tokens its post-processor adds (a count of the vocabulary would miss a sparse id)."""
        ids = self.backend.get_vocab(with_added_tokens=True).values()
        specials = self.backend.encode("", add_special_tokens=True).ids
        return max([*ids, *specials], default=-1) + 1

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``. A long text (``RELEASE_GIL_CHARS`` or more) is tokenised with the GIL
        released (``encode_batch``; ``encode`` holds it), so the process's other threads run meanwhile; a
        short one keeps the GIL, which costs less than handing it back and waiting to take it again."""
        if len(text) < RELEASE_GIL_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; a long list (``RELEASE_GIL_IDS`` or more) is decoded with the GIL released
        (``decode_batch``; ``decode`` holds it), as ``encode`` does for a long text."""
        if len(ids) < RELEASE_GIL_IDS:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render ``messages`` with the checkpoint's chat template into a prompt string."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use the completions API instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template, None)
        if self._parts is None:
            self._parts = iterates_content(self.chat_template)
        if not self._parts:  # a template for string content: text parts joined first, as vLLM does
            messages = _flatten_text_parts(messages) or messages
        try:
            return self._render(messages, add_generation_prompt, extra)
        except Exception as exc:  # the checkpoint's template is code: whatever it raises refuses the request
            flat = _flatten_text_parts(messages)
            if flat is not None:  # a template written for string content, given OpenAI text parts (as vLLM does)
                try:
                    return self._render(flat, add_generation_prompt, extra)
                except Exception:  # noqa: S110  # the first error is the one reported
                    pass
            raise InvalidRequestError(f"chat template rejected the messages: {type(exc).__name__}: {exc}") from None

    def _render(self, messages: list[Message], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        assert self._template is not None
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Render and tokenise. Special tokens come from the template itself, as in transformers; a
        processor's chat also gets the tokenizer's (a BOS) unless the template wrote a BOS already."""
        text = self.render_chat(messages, add_generation_prompt)
        add = self.processor_chat and not (self.bos_token and text.startswith(self.bos_token))
        return self.encode(text, add_special_tokens=add)


def _flatten_text_parts(messages: list[Message]) -> list[Message] | None:
    """The messages with each list of text-only parts joined into one string ("\n" between parts, as vLLM
    joins them); None when there is nothing to flatten or a part is not text (an image)."""
    out, changed = [], False
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                return None
            m = {**m, "content": "\n".join(str(part.get("text", "")) for part in content)}
            changed = True
        out.append(m)
    return out if changed else None


def iterates_content(source: str) -> bool:
    """Whether a chat template loops over a message's content (OpenAI-style parts, as multimodal templates
    do), rather than printing it as a string. A template for strings, given a list of text parts, renders
    its Python repr without an error (Llama-3's ``message['content'] | trim``), so this is decided from the
    template, as vLLM's content-format detection does: a ``for`` over ``x['content']``, ``x.content`` or
    ``x.get('content')``, over a variable set from one, or over a macro's argument (which may be one)."""
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=_EXTENSIONS).parse(source)
    except jinja2.TemplateError:
        return False

    def unfiltered(node: nodes.Node | None) -> nodes.Node | None:
        while isinstance(node, nodes.Filter):  # message['content'] | list, ...
            node = node.node
        return node

    def is_content(node: nodes.Node | None) -> bool:
        node = unfiltered(node)
        return ((isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content")
                or (isinstance(node, nodes.Getattr) and node.attr == "content")
                or (isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) and node.node.attr == "get"
                    and bool(node.args) and isinstance(node.args[0], nodes.Const) and node.args[0].value == "content"))

    aliases = {a.target.name for a in tree.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and is_content(a.node)}
    aliases |= {arg.name for m in tree.find_all(nodes.Macro) for arg in m.args}
    for loop in tree.find_all(nodes.For):
        it = unfiltered(loop.iter)
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in aliases):
            return True
    return False


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _config_template(raw: Any, config_path: Path) -> str | None:
    """The chat template in tokenizer_config.json: a string, or a list of named templates."""
    if isinstance(raw, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default") or next(iter(named.values()), None)
    if raw is not None and not isinstance(raw, str):
        raise CheckpointError(f"{config_path}: chat_template must be a string or a list of "
                              f"{{name, template}} objects, got {raw!r:.80}")
    return raw


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it (for training
    masks) and renders the body unchanged; so does this. Without it such a template would not compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# the extensions transformers renders chat templates with
_EXTENSIONS: tuple[type[jinja2.ext.Extension] | str, ...] = (_GenerationBlock, "jinja2.ext.loopcontrols")


def _compile_template(source: str, origin: Path | None) -> jinja2.Template:
    """Compile as transformers does; ``origin`` (the file it came from) is named in any error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=_EXTENSIONS)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        where = f"{origin}: " if origin is not None else ""
        line = f" (line {exc.lineno})" if isinstance(exc, jinja2.TemplateSyntaxError) else ""
        raise CheckpointError(f"{where}chat template does not compile{line}: {exc}") from None


@dataclass
class DetokenizerStep:
    text: str  # new text safe to emit
    stopped: bool  # a stop string matched; text is cut before it


PRIME_TOKENS = 5  # prompt ids decoded ahead of the output, as vLLM primes its detokenizer
INCOMPLETE = "\ufffd"  # what decode gives for the bytes of a character not complete yet


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, holding back anything that might be the
    start of a stop string or of an unfinished UTF-8 character.

    Each step decodes a short window, not the whole output (vLLM's prefix/read offsets): the text of the
    window's ids up to the last emitted token and the text of the whole window; the new text is the
    difference. The window starts with the last ``PRIME_TOKENS`` prompt ids, so a tokenizer that strips
    the leading space of a decoded text (SentencePiece's Metaspace: Llama-2, Mistral) keeps the first
    generated token's space, as decoding the prompt and the output together would."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self._set_stop(stop)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []  # the output ids given so far
        self.emitted = 0  # characters of ``text`` already emitted
        self.text = ""  # the output's text so far (emitted, and held back for a stop string)
        self.stopped = False
        prime = list(prompt_ids[-PRIME_TOKENS:])
        if prime and self._decode(prime).endswith(INCOMPLETE):  # the prompt ends inside a character
            prime = []
        self._window = prime  # the ids decoded at each step: from the prefix on
        self._read = len(prime)  # window index past the last id whose text is in ``text``

    @classmethod
    def resume(cls, tokenizer: Tokenizer, stop: tuple[str, ...], prompt_ids: Sequence[int],
               output_ids: Sequence[int], emitted: int) -> IncrementalDetokenizer:
        """A detokenizer that has seen ``output_ids`` and emitted the first ``emitted`` characters of their
        text (what another one, primed with the same prompt, sent): it goes on where that one stopped."""
        detok = cls(tokenizer, (), prompt_ids=prompt_ids)
        for token in output_ids:
            detok.add(token)
        detok._set_stop(stop)
        detok.emitted = emitted
        return detok

    def _set_stop(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # characters a stop string may still need

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def _pending(self) -> tuple[str, bool]:
        """The text of the ids past the read offset, and whether it ends inside a character."""
        new = self._decode(self._window)
        return new[len(self._decode(self._window[:self._read])):], new.endswith(INCOMPLETE)

    def _commit(self, tail: str) -> None:
        self.text += tail
        if tail:  # the next step's known text starts at what was read before (a token with no text keeps it)
            del self._window[:self._read]
        self._read = len(self._window)

    def _stop_at(self, text: str) -> int | None:
        """Where the first stop string in ``text`` begins (searching past what is emitted), or None."""
        search_from = max(0, self.emitted - self._hold)
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _cut(self, text: str, cut: int) -> DetokenizerStep:
        delta = text[self.emitted:cut]
        self.text = text[:cut]
        self.emitted = cut
        self.stopped = True
        return DetokenizerStep(delta, True)

    def add(self, token_id: int) -> DetokenizerStep:
        self.ids.append(token_id)
        self._window.append(token_id)
        tail, incomplete = self._pending()
        if not tail and not incomplete and not self._decode([token_id]):  # no text of its own (a skipped special
            self._window.pop()  # token): dropped, so the next word keeps its space and a run of them costs nothing
            return DetokenizerStep("", False)
        if incomplete:  # a multi-byte character is not complete yet: hold it, but not a stop string before it
            if self.stop and (cut := self._stop_at(self.text + tail.rstrip(INCOMPLETE))) is not None:
                return self._cut(self.text + tail, cut)
            return DetokenizerStep("", False)
        self._commit(tail)
        if self.stop and (cut := self._stop_at(self.text)) is not None:
            return self._cut(self.text, cut)
        safe_end = max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted:safe_end]
        self.emitted = safe_end
        return DetokenizerStep(delta, False)

    def flush(self) -> str:
        """Emit what was held back, at the end of a sequence that did not stop on a string (a stop string in
        it is still cut off, with what follows)."""
        if not self.stopped:
            tail, _ = self._pending()
            self._commit(tail)
            if self.stop and (cut := self._stop_at(self.text)) is not None:
                return self._cut(self.text, cut).text
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
