"""The engine's CUDA-graph path without a GPU: ``DecodeGraphs`` with ``stand_in`` replays each captured call
eagerly (Triton's interpreter on CPU), so everything around the graphs runs as on a GPU: the bucket ladder,
the staged pinned buffers, the padded rows, which graph a step takes (the short or the split long-context
variant), the logits' rows and eager past the largest bucket. A sequence's tokens equal the run without
graphs, alone, in a padded bucket and with sequences joining and leaving."""

from __future__ import annotations

import collections
import logging
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.unit.triton_env import DEVICE  # first: sets TRITON_INTERPRET before the kernels are imported
from workers.runtime.cuda_graphs import DecodeGraphs
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.loader import load_model
from workers.runtime.sampler import SamplingParams

from engine_helpers import assert_no_leaks, run_alone, run_joining, run_to_completion, token_ids

pytestmark = [pytest.mark.unit, pytest.mark.transformers]

PROMPTS = [[1, 17, 250, 3, 99, 41, 7], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13], [100, 200, 300]]
MAX_TOKENS = [5, 7, 3, 6]


@pytest.fixture(scope="module")
def model(tiny_hf):
    return load_model(tiny_hf("llama-gqa"), device=str(DEVICE), require_tokenizer=False).model


def _engine(model, max_batch: int | None = None, graph_len: int | None = None, capture: bool = True,
            **config) -> Engine:
    """An engine on the kernel path; with ``max_batch``, its decode graphs are stand-ins (up to that bucket,
    for contexts up to ``graph_len``), captured unless ``capture`` is False."""
    engine = Engine(model, None, EngineConfig(device=str(DEVICE), kv_cache_bytes=1 << 20, max_num_seqs=8,
                                              kernels="triton", cuda_graphs=False, **config))
    if max_batch is not None:
        assert engine._ops is not None
        engine.graphs = DecodeGraphs(model, engine.cache, engine._ops, max_batch, graph_len or engine.max_model_len,
                                     stand_in=True)
        if capture:
            engine.graphs.capture()
    return engine


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(model) -> dict[str, list[int]]:
    return run_alone(lambda: _engine(model), [(p, _params(i)) for i, p in enumerate(PROMPTS)])


def test_padded_buckets_with_sequences_joining_and_leaving_give_the_solotoken_ids(model, solo) -> None:
    engine = _engine(model, max_batch=4)
    assert engine.graphs is not None and engine.graphs.buckets == (1, 2, 4)
    got = run_joining(engine, [(p, _params(i)) for i, p in enumerate(PROMPTS)], every=2)  # a newcomer every other step
    assert engine.graphs.replays > 0
    assert got == solo
    assert_no_leaks(engine)


def test_the_split_long_context_graphs_give_the_solotoken_ids(model, solo) -> None:
    """Graphs for contexts up to 1,024 tokens: bucket 1 and 2 also get the split-attention variant; with the
    short bound set to 0 every step takes it (its splits past a sequence's context read nothing)."""
    engine = _engine(model, max_batch=2, graph_len=1024)
    assert engine.graphs is not None
    assert {bound for _, bound in engine.graphs._graphs} == {engine.graphs.short_context, 1024}
    engine.graphs.short_context = 0
    for i in range(2):
        engine.add_request(str(i), PROMPTS[i], _params(i))
    assert token_ids(run_to_completion(engine)) == {str(i): solo[str(i)] for i in range(2)}
    assert engine.graphs.replays > 0


def test_past_the_largest_bucket_runs_eager_and_says_so(model, solo, caplog) -> None:
    engine = _engine(model, max_batch=2)
    for i in range(3):
        engine.add_request(str(i), PROMPTS[i], _params(i))
    with caplog.at_level(logging.DEBUG, logger="workers.runtime.cuda_graphs"):
        got = token_ids(run_to_completion(engine))
    assert got == {str(i): solo[str(i)] for i in range(3)}
    assert any("past the largest CUDA graph bucket (2): running eager" in r.message for r in caplog.records)
    assert engine.graphs is not None and engine.graphs.replays > 0


def test_every_graph_writes_one_shared_logits_buffer(model) -> None:
    """Graphs that each kept their own logits would hold the sum over the buckets of [bucket, vocab] float32,
    none of it counted when the KV pool was sized."""
    graphs = _engine(model, max_batch=4).graphs
    assert graphs is not None
    outs = [out for _, out in graphs._graphs.values()]
    assert len(outs) >= 3 and {o.shape[0] for o in outs} == {1, 2, 4}
    assert {o.data_ptr() for o in outs} == {outs[0].untyped_storage().data_ptr()}


def test_int8_cache_layers_run_in_the_graphs(model) -> None:
    want = _engine(model, kv_cache_dtype="int8")
    got = _engine(model, max_batch=4, kv_cache_dtype="int8")
    for engine in (want, got):
        for i in range(3):
            engine.add_request(str(i), PROMPTS[i], _params(i))
    assert token_ids(run_to_completion(got)) == token_ids(run_to_completion(want))
    assert got.graphs is not None and got.graphs.replays > 0


def test_a_failed_capture_is_logged_and_every_step_runs_eager(model, solo, caplog, monkeypatch) -> None:
    """CUDA refusing an operation while capturing does not stop the engine: every graph is dropped, the error
    is logged with its reason and kept, and the tokens are those of the run without graphs."""
    from workers.runtime import cuda_graphs

    def refuse(self, fn) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(cuda_graphs.EagerStandIn, "__init__", refuse)
    with caplog.at_level(logging.ERROR, logger="workers.runtime.cuda_graphs"):
        engine = _engine(model, max_batch=4)
    assert engine.graphs is not None
    assert engine.graphs.capture_error == "RuntimeError: operation not permitted when stream is capturing"
    assert any("CUDA graph capture failed, decode steps run eager" in r.message for r in caplog.records)
    for i in range(2):
        engine.add_request(str(i), PROMPTS[i], _params(i))
    assert token_ids(run_to_completion(engine)) == {str(i): solo[str(i)] for i in range(2)}
    assert engine.graphs.replays == 0


# What a captured region must not do on a GPU: wait for the device (a value read back to the host), make a
# shape from data (nonzero, boolean-mask indexing), or copy host data in (torch.tensor of a list).
HOST_ROUND_TRIPS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
                    "masked_select", "unique", "tensor", "as_tensor", "synchronize"}
ROOT = str(Path(__file__).resolve().parents[2])


def _has_mask(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype == torch.bool
    return isinstance(x, (tuple, list)) and any(_has_mask(i) for i in x)


class _ProjectCalls(TorchFunctionMode):
    """Counts each torch function or tensor method this checkout's code calls (not Triton's interpreter, nor
    torch's own internals), and whether one indexed by a boolean mask."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self.mask_index = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        caller: FrameType | None = sys._getframe(1)
        while caller is not None and "/torch/" in caller.f_code.co_filename:
            caller = caller.f_back
        where = caller.f_code.co_filename if caller is not None else ""
        if where.startswith(ROOT) and "site-packages" not in where:
            name = getattr(func, "__name__", str(func))
            self.calls[name] += 1
            if name in ("__getitem__", "__setitem__", "index_put", "index_put_") and _has_mask(args[1:]):
                self.mask_index = True
        return func(*args, **(kwargs or {}))


def _captured_calls(engine: Engine) -> _ProjectCalls:
    assert engine.graphs is not None
    with _ProjectCalls() as project:
        engine.graphs.capture()  # the stand-ins run each captured call once, as torch.cuda.graph records it
    assert engine.graphs.capture_error is None, engine.graphs.capture_error
    return project


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8", "fp8"])
def test_the_captured_decode_step_never_waits_for_the_device(model, cache_dtype: str) -> None:
    """Every variant's captured call, as this checkout's code runs it: no value read back to the host, no
    shape made from data, no host data copied in. On a GPU each of these fails the capture or freezes a value
    into the graph; the stand-in runs the same code, so it is checked here."""
    engine = _engine(model, max_batch=4, graph_len=1024, capture=False, kv_cache_dtype=cache_dtype)
    project = _captured_calls(engine)
    assert project.calls["linear"] > 0  # the model ran under the check
    found = HOST_ROUND_TRIPS & set(project.calls)
    assert not found, {k: project.calls[k] for k in found}
    assert not project.mask_index


def test_the_capture_check_sees_a_value_read_back(model, monkeypatch) -> None:
    """The check above can fail: a decode step that reads one value back (as a gather path's max length
    did) or indexes by a mask is caught."""
    from workers.runtime import model as model_module

    engine = _engine(model, max_batch=2, capture=False)
    original = model_module.DecoderModel.forward

    def reads_back(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        int(batch.positions.max().item())
        _ = batch.positions[batch.positions > 0]
        return original(self, batch, *args, **kwargs)
    monkeypatch.setattr(model_module.DecoderModel, "forward", reads_back)
    project = _captured_calls(engine)
    assert project.calls["item"] > 0 and project.mask_index


def test_the_benchmarks_step_breakdown_times_the_replays_and_then_stops(model) -> None:
    """``epd bench engine --device cuda`` splits a batch-1 step into its graph and the rest. With stand-ins the
    replays are timed on the wall clock: every decode step of the run is timed, each for less than its whole
    step, and the timing is off again afterwards (no events kept, none recorded)."""
    from bench.gpu_engine_bench import step_breakdown

    engine = _engine(model, max_batch=2)
    graphs = engine.graphs
    assert graphs is not None
    replays = graphs.replays
    recorded: list[int] = []
    timed = graphs._timed_replay

    def counting(graph: Any, events: list) -> None:
        timed(graph, events)
        recorded.append(len(events))
    graphs._timed_replay = counting  # type: ignore[method-assign]  # count what the real timer recorded
    line = step_breakdown(engine, model.cfg.vocab_size, 6, roofline=1e6)
    assert line is not None and line.startswith("batch-1 step "), line
    step_us, graph_us, outside_us = (float(w) for w in
                                     (line.split()[2], line.split(" its graph ")[1].split()[0],
                                      line.split("), ")[1].split()[0]))
    assert 0 < graph_us < step_us and outside_us == pytest.approx(step_us - graph_us, abs=1.0)
    assert recorded == list(range(1, graphs.replays - replays + 1))  # 6 tokens: the 5 after the prefill's
    assert graphs.replays - replays == 5
    assert graphs.replay_events is None
    engine.add_request("after", PROMPTS[0], _params(0))
    run_to_completion(engine)
    assert len(recorded) == 5  # timing is off after the breakdown
    assert_no_leaks(engine)


def test_the_step_breakdown_needs_captured_graphs(model) -> None:
    from bench.gpu_engine_bench import step_breakdown

    assert step_breakdown(_engine(model), model.cfg.vocab_size, 4, roofline=1e6) is None
