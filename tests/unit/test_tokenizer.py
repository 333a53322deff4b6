"""Tokenizer: chat templates render and encode exactly as transformers does; the incremental
detokenizer emits exactly the decoded text, cuts stop strings exactly and never emits half a character."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.runtime import default_model
from workers.runtime.default_model import BOS, CHAT_TEMPLATE, EOS, IM_END, IMAGE
from workers.runtime.errors import CheckpointError, InvalidRequestError
from workers.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = [pytest.mark.unit]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

def _id(tok: Tokenizer, token: str) -> int:
    found = tok.token_to_id(token)
    assert found is not None, f"no {token!r} in the tokenizer"
    return found


MESSAGE_LISTS: dict[str, list[dict[str, Any]]] = {
    "single-user": [{"role": "user", "content": "Hello, world."}],
    "multi-turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of  Spain?\nAnswer in one word."},
    ],
    "parts-with-images": [
        {"role": "user", "content": [
            {"type": "text", "text": "Describe "},
            {"type": "image"},
            {"type": "text", "text": " and compare with "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]},
    ],
    "unicode-and-empty": [
        {"role": "system", "content": ""},
        {"role": "user", "content": "naïve café 🎉 日本語 — {braces} <tags>"},
    ],
}

MIXED_TEXT = "héllo wörld 🎉 naïve — ok 日本語!"


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model.write_default_checkpoint(tmp_path_factory.mktemp("default"), with_vision=False)


@pytest.fixture
def tok_dir(default_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the default tokenizer files, safe to edit."""
    for name in TOKENIZER_FILES:
        shutil.copy(default_dir / name, tmp_path / name)
    return tmp_path


@pytest.fixture(scope="module")
def tok(default_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_dir)


@pytest.fixture(scope="module")
def hf_tok(default_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_dir)


def _hf_chat_ids(hf_tok, messages, add_generation_prompt: bool = True) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5


def _pieces(tok: Tokenizer, *chunks: str) -> list[int]:
    """Ids whose token boundaries fall at least at every chunk boundary."""
    return [i for chunk in chunks for i in tok.encode(chunk, add_special_tokens=False)]


def _stream(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], bool, str]:
    """Feed ids one by one; returns (deltas, stopped, flushed text). Stops feeding once stopped."""
    detok = IncrementalDetokenizer(tok, stop=stop)
    deltas: list[str] = []
    stopped = False
    for i in ids:
        step = detok.add(i)
        deltas.append(step.text)
        if step.stopped:
            stopped = True
            break
    return deltas, stopped, detok.flush()


# ---------------------------------------------------------------- loading
def test_from_folder_reads_files(tok: Tokenizer, default_dir: Path) -> None:
    assert tok.chat_template == CHAT_TEMPLATE
    assert (tok.bos_token, tok.eos_token, tok.image_token) == (BOS, IM_END, IMAGE)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(IMAGE) is not None
    assert tok.vocab_size == json.loads((default_dir / "config.json").read_text())["vocab_size"]


def test_template_falls_back_to_tokenizer_config(tok_dir: Path) -> None:
    (tok_dir / "chat_template.jinja").unlink()
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(tok_dir)
    assert tok.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == \
        "[user]hi[assistant]yo"


def test_named_template_list_picks_default(tok_dir: Path) -> None:
    (tok_dir / "chat_template.jinja").unlink()
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_folder(tok_dir).render_chat([{"role": "user", "content": "x"}]) == "PLAIN"


def test_jinja_file_wins_over_tokenizer_config(tok_dir: Path) -> None:
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "FROM CONFIG"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_folder(tok_dir).chat_template == CHAT_TEMPLATE


def test_no_template_is_an_invalid_request(tok_dir: Path) -> None:
    (tok_dir / "chat_template.jinja").unlink()
    tok = Tokenizer.from_folder(tok_dir)
    assert tok.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json(tok_dir: Path) -> None:
    (tok_dir / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json not found"):
        Tokenizer.from_folder(tok_dir)


def test_garbage_tokenizer_files(tok_dir: Path) -> None:
    (tok_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_folder(tok_dir)
    (tok_dir / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(CheckpointError, match="unreadable tokenizer"):
        Tokenizer.from_folder(tok_dir)


def test_raise_exception_in_template_is_an_invalid_request(tok: Tokenizer) -> None:
    guarded = Tokenizer(tok.backend, chat_template=(
        "{% for m in messages %}{% if m['role'] not in ('user', 'assistant') %}"
        "{{ raise_exception('roles must be user or assistant, got ' + m['role']) }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"))
    assert guarded.render_chat([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="roles must be user or assistant, got tool"):
        guarded.render_chat([{"role": "tool", "content": "x"}])


def test_template_that_does_not_compile(tok: Tokenizer) -> None:
    with pytest.raises(CheckpointError, match="does not compile"):
        Tokenizer(tok.backend, chat_template="{% for m in messages %}").render_chat([])


# ---------------------------------------------------------------- parity with transformers
@pytest.mark.transformers
@pytest.mark.parametrize("name", list(MESSAGE_LISTS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_matches_transformers(tok: Tokenizer, hf_tok, name: str, add_generation_prompt: bool) -> None:
    messages = MESSAGE_LISTS[name]
    ours = tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.startswith(BOS) and ours.endswith("<|im_start|>assistant\n") is add_generation_prompt


@pytest.mark.transformers
@pytest.mark.parametrize("name", list(MESSAGE_LISTS))
def test_encode_chat_matches_transformers(tok: Tokenizer, hf_tok, name: str) -> None:
    ids = tok.encode_chat(MESSAGE_LISTS[name])
    assert ids == _hf_chat_ids(hf_tok, MESSAGE_LISTS[name])
    bos = _id(tok, BOS)
    assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS, not a second one from encode


def test_image_parts_become_image_tokens(tok: Tokenizer) -> None:
    ids = tok.encode_chat(MESSAGE_LISTS["parts-with-images"])
    assert ids.count(_id(tok, IMAGE)) == 2


@pytest.mark.transformers
@pytest.mark.parametrize("text", ["Hello, world.", MIXED_TEXT, "  leading spaces\n\ttabs", ""])
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert ids[0] == tok.token_to_id(BOS)
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS + text


# ---------------------------------------------------------------- incremental detokenizer
@pytest.mark.parametrize("text", ["The quick brown fox jumps over the lazy dog.", MIXED_TEXT, "a\n\nb  c"])
def test_deltas_concatenate_to_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False) + [_id(tok, EOS)]
    deltas, stopped, tail = _stream(tok, ids)
    assert not stopped
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert tail == ""  # without stop strings nothing is held back once characters are complete


def test_split_utf8_characters_are_never_emitted_half_done(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED_TEXT, add_special_tokens=False)
    assert len(ids) > len(MIXED_TEXT.encode("utf-8")) // 2  # really byte-level: multi-byte chars span tokens
    detok = IncrementalDetokenizer(tok)
    emitted = ""
    for n, i in enumerate(ids, 1):
        delta = detok.add(i).text
        assert "\ufffd" not in delta
        emitted += delta
        assert MIXED_TEXT.startswith(emitted)
        # whatever is withheld is exactly the still-incomplete last character
        assert tok.decode(ids[:n]).replace("\ufffd", "") == emitted
    assert emitted + detok.flush() == MIXED_TEXT


def test_emoji_bytes_are_held_until_complete(tok: Tokenizer) -> None:
    emoji = tok.encode("🎉", add_special_tokens=False)
    assert len(emoji) == 4  # one token per byte in the demo vocabulary
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i).text for i in emoji] == ["", "", "", "🎉"]


def test_stop_string_across_token_boundaries(tok: Tokenizer) -> None:
    ids = _pieces(tok, "Hello", " S", "T", "O", "P", " world")
    deltas, stopped, tail = _stream(tok, ids, stop=("STOP",))
    assert stopped
    assert len(deltas) == 5  # stopped on the token that completed "STOP"
    assert "".join(deltas) + tail == "Hello "
    assert tail == ""


def test_partial_stop_string_is_held_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=("STOP",))
    emitted = ""
    for i in _pieces(tok, "Hello", " S", "T"):
        step = detok.add(i)
        assert not step.stopped
        emitted += step.text
    assert "S" not in emitted and "Hello ST".startswith(emitted)
    for i in _pieces(tok, "AR", "s", " shine"):
        step = detok.add(i)
        assert not step.stopped
        emitted += step.text
    assert "Hello STARs shine".startswith(emitted)
    assert emitted + detok.flush() == "Hello STARs shine"
    assert not detok.stopped


def test_stop_string_inside_one_token(tok: Tokenizer) -> None:
    ids = tok.encode("Hello there", add_special_tokens=False)
    assert tok.decode(ids[:1]) == "Hello"
    deltas, stopped, tail = _stream(tok, ids, stop=("ell",))
    assert stopped and deltas == ["H"] and tail == ""


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    ids = _pieces(tok, "one", " two", " three", " four")
    deltas, stopped, _ = _stream(tok, ids, stop=("four", "o th", "three"))
    assert stopped and "".join(deltas) == "one tw"


def test_stop_string_of_multibyte_characters(tok: Tokenizer) -> None:
    deltas, stopped, tail = _stream(tok, tok.encode(MIXED_TEXT, add_special_tokens=False), stop=("🎉",))
    assert stopped and "".join(deltas) + tail == "héllo wörld "
    assert all("\ufffd" not in d for d in deltas)


def test_no_stop_means_full_text_with_stop_strings_configured(tok: Tokenizer) -> None:
    text = "Monday, Tuesday, Wednesday"
    deltas, stopped, tail = _stream(tok, tok.encode(text, add_special_tokens=False), stop=("Friday", "!"))
    assert not stopped and "".join(deltas) + tail == text
    assert len(tail) <= len("Friday") - 1  # at most the hold-back window remains for flush


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    ids = [_id(tok, IM_END)] + tok.encode("ok", add_special_tokens=False) + [_id(tok, EOS)]
    deltas, _, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == "ok"


# ------------------------------------------------------------------ tokenizers unlike the demo's
def _metaspace() -> Tokenizer:
    """A SentencePiece-style tokenizer (Llama-2, Mistral): words carry a leading "▁", and decoding strips
    the text's first one."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁of": 3, "▁France": 4, "▁is": 5, "▁Paris": 6, ".": 7,
             "<sep>": 8}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.add_special_tokens(["<sep>"])
    return Tokenizer(backend)


def test_the_first_generated_word_keeps_its_leading_space_with_a_sentencepiece_tokenizer() -> None:
    """Decoding the output alone strips its first "▁": a client joining prompt and completion got
    "France isParis." (vLLM primes its detokenizer with the prompt's last ids; so does this one)."""
    tok = _metaspace()
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out = [6, 7]  # "▁Paris", "."
    assert tok.decode(prompt) == "The capital of France is" and tok.decode(out) == "Paris."  # the output alone
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.add(i).text for i in out) + detok.flush()
    assert text == " Paris." == tok.decode(prompt + out)[len(tok.decode(prompt)):]
    resumed = IncrementalDetokenizer.resume(tok, (), prompt, out[:1], emitted=len(" Paris"))
    assert resumed.add(out[1]).text == "."  # a relay going on after a seam emits what the worker would have
    # a special token (skipped in the text) between two words keeps the second one's space
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    words = [6, 8, 4]  # "▁Paris", "<sep>", "▁France"
    text = "".join(detok.add(i).text for i in words) + detok.flush()
    assert text == " Paris France" == tok.decode(prompt + words)[len(tok.decode(prompt)):]


@contextlib.contextmanager
def _decoded_lengths(tok: Tokenizer) -> Iterator[list[int]]:
    """Within the block, the length of every id list ``tok`` decodes is appended to the yielded list."""
    lengths: list[int] = []
    decode = tok.decode

    def counting(ids: list[int], skip_special_tokens: bool = True) -> str:
        lengths.append(len(ids))
        return decode(ids, skip_special_tokens)
    tok.decode = counting  # type: ignore[method-assign]
    try:
        yield lengths
    finally:
        del tok.decode


def test_each_step_decodes_a_few_ids_not_the_whole_output(tok: Tokenizer) -> None:
    """Decoding the whole output at every token made a step cost grow with the output's length (1 ms per
    token at 8,192 tokens), under the engine's lock."""
    ids = tok.encode(MIXED_TEXT * 20, add_special_tokens=False)
    with _decoded_lengths(tok) as lengths:
        detok = IncrementalDetokenizer(tok, prompt_ids=ids[:50])
        emitted = "".join(detok.add(i).text for i in ids) + detok.flush()
    assert emitted == tok.decode(ids)
    assert max(lengths) <= 5 + 8  # the prompt's prime, and the bytes of one character still incomplete


def test_a_stop_string_before_an_unfinished_character_is_cut_even_when_the_output_ends_there() -> None:
    """A token holding the end of a stop string and the first byte of a character: the stop string was
    only looked for once the character completed, and a sequence ending there flushed it to the client."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    # byte-level alphabet: "Ã" is byte 0xC3, "¦" byte 0xA6 (together "æ")
    backend = HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1, "bÃ": 2, "¦": 3}, unk_token="<unk>"))
    backend.decoder = decoders.ByteLevel()
    tok = Tokenizer(backend)
    assert tok.decode([1, 2]) == "ab\ufffd" and tok.decode([1, 2, 3]) == "abæ"
    for ended in (True, False):
        detok = IncrementalDetokenizer(tok, stop=("ab",))
        first, second = detok.add(1), detok.add(2)
        assert first.text == "" and second.stopped and second.text == ""
        assert (detok.flush() if ended else "") == "" and detok.text == ""
    detok = IncrementalDetokenizer(tok, stop=("zz",))  # no stop: one character held back, then all of it
    assert [detok.add(i).text for i in (1, 2, 3)] == ["", "", "ab"] and detok.flush() == "æ"


LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's, for string content
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_text_parts_reach_a_string_template_as_one_string(tok: Tokenizer) -> None:
    """Llama-3's template prints ``message['content'] | trim``: given a list of parts it rendered their
    Python repr without an error, so the fallback on errors never ran."""
    llama3 = Tokenizer(tok.backend, bos_token="<|begin_of_text|>", chat_template=LLAMA3_TEMPLATE)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    rendered = llama3.render_chat(parts)
    assert "'type'" not in rendered
    assert rendered == llama3.render_chat([{"role": "user", "content": "Hi\nthere"}])


def test_a_template_that_loops_over_parts_gets_them_as_they_are(tok: Tokenizer) -> None:
    from workers.runtime.tokenizer import iterates_content

    assert not iterates_content(LLAMA3_TEMPLATE)
    assert iterates_content(CHAT_TEMPLATE)  # the demo model's: text and image parts
    assert iterates_content("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}"
                            "{% endfor %}{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert "user\nHithere<|im_end|>" in tok.render_chat(parts)  # the template's own joining, as transformers
    # loops the detection does not see (a .get, a macro's argument) still get the parts as they are
    for source in ("{% for m in messages %}[{% for p in m.get('content') %}{{ p['text'] }}{% endfor %}]{% endfor %}",
                   "{% macro body(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
                   "{% for m in messages %}[{{ body(m['content']) }}]{% endfor %}"):
        assert Tokenizer(tok.backend, chat_template=source).render_chat(parts, add_generation_prompt=False) == \
            "[Hithere]"


def test_a_run_of_skipped_special_tokens_keeps_the_window_short(tok: Tokenizer) -> None:
    """A model that keeps emitting a special token (with ignore_eos) grew the window by one id a token and
    decoded all of it each time."""
    special = _id(tok, BOS)
    with _decoded_lengths(tok) as lengths:
        detok = IncrementalDetokenizer(tok)
        text = "".join(detok.add(i).text for i in [special] * 500 + tok.encode(" done", add_special_tokens=False))
    assert text + detok.flush() == " done" and max(lengths) <= 8


@pytest.mark.parametrize("source", [
    "{% for m in messages %}{{ m.content | tojson }}{% endfor %}",  # Llama-3.1's tool turns print content so
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{{ m.content[0].text }}"
    "{% endif %}{% endfor %}",
])
def test_a_template_that_does_not_loop_over_parts_gets_them_joined(tok: Tokenizer, source: str) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    rendered = Tokenizer(tok.backend, chat_template=source).render_chat(parts, add_generation_prompt=False)
    assert "Hi" in rendered and "there" in rendered and "type" not in rendered
