"""Datasets (lengths, prefixes, images, ShareGPT parsing incl. malformed files) and flag parsing."""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from bench.serve.config import (
    BenchInputError,
    DatasetConfig,
    DatasetName,
    ServeBenchConfig,
    normalize_url,
    parse_float_list,
    parse_image_sizes,
    parse_slo,
)
from bench.serve.datasets import build_requests, load_sharegpt
from workers.runtime.default_model import build_tokenizer

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_tokenizer().save(str(path))
    return path


def test_random_lengths_follow_the_range_and_the_seed():
    cfg = DatasetConfig("random", num_prompts=200, input_len=100, output_len=20, range_ratio=0.5)
    reqs = build_requests(cfg, seed=1)
    assert len(reqs) == 200
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 20  # actually spread
    assert all(len(r.text.split()) == r.prompt_len for r in reqs)  # one word per token without a tokenizer
    assert build_requests(cfg, seed=1) == reqs and build_requests(cfg, seed=2) != reqs
    fixed = build_requests(DatasetConfig("random", num_prompts=5, input_len=7, output_len=3), 0)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(7, 3)}


def test_a_tokenizer_gives_exact_prompt_lengths(tokenizer_file: Path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_file))
    cfg = DatasetConfig("random", num_prompts=20, input_len=64, output_len=8, tokenizer=tokenizer_file)
    lengths = [len(tok.encode(r.text, add_special_tokens=False).ids) for r in build_requests(cfg, seed=0)]
    assert lengths.count(64) >= 18 and all(62 <= n <= 66 for n in lengths)  # round trips may shift a token
    assert build_requests(replace(cfg, tokenizer=tokenizer_file.parent), 0)  # the folder works too
    with pytest.raises(BenchInputError, match="no tokenizer.json"):
        build_requests(replace(cfg, tokenizer=tokenizer_file.parent / "nope"), 0)


def test_prefix_repetition_shares_n_prefixes_with_unique_suffixes():
    cfg = DatasetConfig("prefix", num_prompts=40, input_len=10, output_len=4, num_prefixes=3, prefix_len=30)
    reqs = build_requests(cfg, seed=5)
    prefixes = {" ".join(r.text.split()[:30]) for r in reqs}
    suffixes = [" ".join(r.text.split()[30:]) for r in reqs]
    assert len(prefixes) == 3
    assert len(set(suffixes)) == 40 and all(len(s.split()) == 10 for s in suffixes)
    assert all(r.prompt_len == 40 for r in reqs)
    counts = sorted(sum(r.text.startswith(p) for r in reqs) for p in prefixes)
    assert counts == [13, 13, 14]


def test_multimodal_requests_carry_png_data_urls_of_the_given_sizes():
    cfg = DatasetConfig("multimodal", num_prompts=3, input_len=8, output_len=4, images_per_request=2,
                        image_sizes=tuple(parse_image_sizes("32x16,8x8,20x24")))
    reqs = build_requests(cfg, seed=0)
    sizes = []
    for r in reqs:
        assert len(r.image_urls) == 2 and len(r.text.split()) == 8
        for url in r.image_urls:
            head, b64 = url.split(",", 1)
            assert head == "data:image/png;base64"
            img = Image.open(io.BytesIO(base64.b64decode(b64)))
            assert img.format == "PNG" and img.mode == "RGB"
            sizes.append(img.size)
    assert sizes == [(32, 16), (8, 8), (20, 24), (32, 16), (8, 8), (20, 24)]
    assert reqs[0].image_urls[0] != reqs[1].image_urls[1]  # same size, different noise


def _write(tmp_path: Path, data: object | str) -> Path:
    path = tmp_path / "sg.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _conv(q: str, a: str) -> dict:
    return {"id": "x", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


def test_sharegpt_takes_first_two_turns_filters_and_cycles(tmp_path: Path):
    long_q = "word " * 30
    data = [_conv(long_q, "answer " * 20), _conv("hi", "a very long answer " * 5),  # prompt < 4 tokens: dropped
            {"conversations": [{"from": "human", "value": "only one turn"}]},        # < 2 turns: skipped
            {"messages": [{"role": "user", "content": "q " * 40}, {"role": "assistant", "content": "b " * 40}]}]
    path = _write(tmp_path, data)
    assert len(load_sharegpt(path)) == 3
    reqs = build_requests(DatasetConfig("sharegpt", num_prompts=5, path=path), seed=0)
    assert len(reqs) == 5 and {r.text for r in reqs} == {long_q, "q " * 40}
    assert {r.output_len for r in reqs} == {round(len("answer " * 20) / 4), 20}  # about 4 characters a token
    fixed = build_requests(DatasetConfig("sharegpt", num_prompts=2, path=path, sharegpt_output_len=9), 0)
    assert {r.output_len for r in fixed} == {9}


@pytest.mark.parametrize("name", ["random", "prefix", "multimodal"])
def test_each_load_point_has_the_same_lengths_and_text_of_its_own(name: DatasetName):
    """A sweep's later points (and the warm-up, built as the point after the last) must not repeat an earlier
    point's prompts, or a server with a prefix cache answers them from it; their lengths stay the same, so
    the points differ in load only. Point 0 is what ``build_requests`` always gave."""
    cfg = DatasetConfig(name, num_prompts=12, input_len=20, output_len=5, range_ratio=0.5, num_prefixes=2,
                        prefix_len=6, images_per_request=1, image_sizes=((8, 8),))
    points = [build_requests(cfg, 7, point=k) for k in range(3)]
    assert points[0] == build_requests(cfg, 7)
    assert [[(r.prompt_len, r.output_len) for r in reqs] for reqs in points[1:]] == \
        [[(r.prompt_len, r.output_len) for r in points[0]]] * 2
    for a in range(3):
        for b in range(a):
            assert not {r.text for r in points[a]} & {r.text for r in points[b]}
            assert not {u for r in points[a] for u in r.image_urls} & {u for r in points[b] for u in r.image_urls}
    assert build_requests(cfg, 7, point=2) == points[2]  # still deterministic in the seed


def test_sharegpt_load_points_take_successive_conversations(tmp_path: Path):
    path = _write(tmp_path, [_conv(f"question number {i} " * 3, "an answer to it " * 3) for i in range(6)])
    cfg = DatasetConfig("sharegpt", num_prompts=2, path=path)
    texts = [[r.text for r in build_requests(cfg, 0, point=k)] for k in range(4)]
    assert len({t for point in texts[:3] for t in point}) == 6  # three points use all six, none twice
    assert texts[3] == texts[0]  # a fourth has to cycle


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"conversations": []}', "expected a JSON list of conversations, got a dict"),
    ('[{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]}]', "entry 0: a turn needs a string"),
    ('[{"conversations": [{"from": "human", "value": "hello there you"}, 5]}]', "entry 0: a turn must be an object"),
    ('[1]', 'entry 0: expected an object with a "conversations" list'),
    ('[{"conversations": [{"from": "human", "value": "q"}]}]', "no conversation with at least two turns"),
    ('[{"conversations": [{"value": "q"}, {"value": "a"}]}]', "no conversation fits"),
])
def test_malformed_sharegpt_files_name_the_problem(tmp_path: Path, content: str, message: str):
    path = _write(tmp_path, content)
    with pytest.raises(BenchInputError, match=message):
        build_requests(DatasetConfig("sharegpt", num_prompts=2, path=path), 0)


def test_missing_or_binary_dataset_files_are_input_errors(tmp_path: Path):
    with pytest.raises(BenchInputError, match="cannot read dataset file"):
        load_sharegpt(tmp_path / "missing.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(BenchInputError, match="cannot read dataset file|not valid JSON"):
        load_sharegpt(tmp_path / "bin.json")
    with pytest.raises(BenchInputError, match="needs --dataset-path"):
        build_requests(DatasetConfig("sharegpt"), 0)


def test_slo_specs():
    assert parse_slo(["ttft:200", "tpot:50"]).as_dict() == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo("e2e:1000, TTFT:2.5").as_dict() == {"e2e": 1000.0, "ttft": 2.5}
    assert parse_slo(None).is_empty()
    for bad, msg in (("ttft:-1", "impossible SLO"), ("tpot:0", "impossible SLO"), ("ttft:inf", "impossible"),
                     ("foo:3", "METRIC one of ttft, tpot, e2e"), ("ttft", "expected METRIC:MS"),
                     ("ttft:abc", "not a number"), ("ttft:1 ttft:2", "given twice")):
        with pytest.raises(BenchInputError, match=msg):
            parse_slo(bad)


def test_urls_rates_and_sizes():
    assert normalize_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalize_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    assert normalize_url("https://api.example.com/openai") == "https://api.example.com/openai/v1"
    for bad in ("127.0.0.1:8000", "ftp://h", "http://", "http://h:99999", "http://h:8000?x=1", "not a url"):
        with pytest.raises(BenchInputError, match="bad URL"):
            normalize_url(bad)
    assert parse_float_list("1, 2.5,inf", "rate", allow_inf=True) == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "x", "1,,2", "nan"):
        with pytest.raises(BenchInputError, match="bad rate"):
            parse_float_list(bad, "rate", allow_inf=True)
    with pytest.raises(BenchInputError, match="bad image size"):
        parse_image_sizes("224")
    with pytest.raises(BenchInputError, match="only --endpoint chat"):
        ServeBenchConfig("http://h", endpoint="completions", dataset=DatasetConfig("multimodal")).validate()
    assert ServeBenchConfig("http://h", dataset=DatasetConfig("multimodal")).resolved_endpoint() == "chat"
    with pytest.raises(BenchInputError, match="--concurrency"):
        ServeBenchConfig("http://h", concurrency=0).validate()
