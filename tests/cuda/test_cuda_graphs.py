"""CUDA graphs keep a sequence's tokens what they are alone: in a padded bucket, with sequences joining
and leaving, and past the largest bucket (eager, said in a debug log). The KV pool follows
gpu_memory_utilization."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.cuda.helpers import CUDA
from workers.runtime.devices import memory_baseline
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.kv_cache import DenseLayerStorage
from workers.runtime.loader import load_model
from workers.runtime.sampler import SamplingParams

from engine_helpers import assert_no_leaks, run_alone, run_joining, run_to_completion, token_ids

pytestmark = [*CUDA, pytest.mark.transformers]

PROMPTS = [[1, 17, 250, 3, 99, 41, 7], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17, 18],
           [100, 200, 300], [42] * 25]
MAX_TOKENS = [12, 20, 8, 16, 10]


@pytest.fixture(scope="module")
def model(tiny_hf):
    return load_model(tiny_hf("llama-gqa"), device="cuda", require_tokenizer=False).model


def _engine(model, **config) -> Engine:
    engine = Engine(model, None, EngineConfig(device="cuda", kv_cache_bytes=1 << 26, max_num_seqs=8, **config))
    assert engine.graphs is None or engine.graphs.capture_error is None, engine.graphs.capture_error
    return engine


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(model) -> dict[str, list[int]]:
    return run_alone(lambda: _engine(model, cuda_graphs=False), [(p, _params(i)) for i, p in enumerate(PROMPTS)])


def test_padded_bucket_gives_the_solotoken_ids(model, solo) -> None:
    engine = _engine(model)
    for i in range(3):  # three sequences decode in the bucket of 4: one padded row
        engine.add_request(str(i), PROMPTS[i], _params(i))
    got = token_ids(run_to_completion(engine))
    assert engine.graphs is not None and engine.graphs.replays > 0
    assert got == {str(i): solo[str(i)] for i in range(3)}
    assert_no_leaks(engine)


def test_joining_and_leaving_give_the_solotoken_ids(model, solo) -> None:
    engine = _engine(model)
    got = run_joining(engine, [(p, _params(i)) for i, p in enumerate(PROMPTS)], every=3)  # a newcomer every third step
    assert engine.graphs is not None and engine.graphs.replays > 0
    assert got == solo
    assert_no_leaks(engine)


def test_a_plain_cuda_device_is_the_index_the_tensors_report(model) -> None:
    engine = _engine(model)
    storage = engine.cache.layers[0]
    assert isinstance(storage, DenseLayerStorage)
    index = torch.cuda.current_device()
    assert model.device == engine.cache.device == storage.k.device == torch.device("cuda", index)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_second_gpu_driven_from_another_thread_gives_the_same_tokens(tiny_hf, solo) -> None:
    # Triton launches and graph capture follow the thread's current device (0 in a new thread), not the tensors'
    second = load_model(tiny_hf("llama-gqa"), device="cuda:1", require_tokenizer=False).model

    def run() -> dict[str, list[int]]:
        def make() -> Engine:
            engine = Engine(second, None, EngineConfig(device="cuda:1", kv_cache_bytes=1 << 26, max_num_seqs=8))
            assert engine.graphs is not None and engine.graphs.capture_error is None
            return engine
        return run_alone(make, [(p, _params(i)) for i, p in enumerate(PROMPTS)])

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(run).result() == solo


def test_past_the_largest_bucket_runs_eager_and_says_so(model, solo, caplog) -> None:
    engine = _engine(model, cuda_graph_max_batch=2)
    assert engine.graphs is not None and engine.graphs.buckets == (1, 2)
    for i in range(4):
        engine.add_request(str(i), PROMPTS[i], _params(i))
    with caplog.at_level(logging.DEBUG, logger="workers.runtime.cuda_graphs"):
        got = token_ids(run_to_completion(engine))
    assert got == {str(i): solo[str(i)] for i in range(4)}
    assert any("past the largest CUDA graph bucket (2): running eager" in r.message for r in caplog.records)
    assert engine.graphs.replays > 0  # once two of them finished, the rest replays the graphs again


def test_int8_cache_layers_run_in_the_graphs(model) -> None:
    want = _engine(model, cuda_graphs=False, kv_cache_dtype="int8")
    got = _engine(model, kv_cache_dtype="int8")
    for engine in (want, got):
        for i in range(3):
            engine.add_request(str(i), PROMPTS[i], _params(i))
    assert token_ids(run_to_completion(got)) == token_ids(run_to_completion(want))


def test_kv_pool_is_sized_from_free_memory(model) -> None:
    sizes = {}
    for util in (0.3, 0.6):
        gc.collect()  # models and engines of earlier tests hold device memory until collected
        torch.cuda.empty_cache()
        engine = Engine(model, None, EngineConfig(device="cuda", gpu_memory_utilization=util, max_num_seqs=4))
        free, total = torch.cuda.mem_get_info()
        sizes[util] = engine.cache.nbytes
        # counted from what the GPU held when this process first loaded a model (its CUDA context included)
        taken = total - free - memory_baseline(model.device)[0]
        assert taken <= util * total + 512 * 2**20, "the engine took more than gpu_memory_utilization"
        del engine
    assert sizes[0.6] > sizes[0.3] + 0.25 * torch.cuda.mem_get_info()[1]


# A fresh process: its memory baseline is what the GPU holds when it loads the model (workers.runtime.devices).
POOL_CHILD = """
import sys
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.loader import load_model
model = load_model(sys.argv[1], device="cuda", require_tokenizer=False).model
engine = Engine(model, None, EngineConfig(device="cuda", gpu_memory_utilization=0.3, max_num_seqs=4, cuda_graphs=False))
print(engine.cache.nbytes)
"""
HOLDER = ("import sys, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda'); "
          "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()")


def test_memory_another_process_held_first_leaves_this_engines_share_alone(tiny_hf) -> None:
    """gpu_memory_utilization is the share of the card this process takes (vLLM's meaning), so engines sharing
    a GPU each get theirs: with another process holding a fifth of the card, an engine at 0.3 gets the pool
    it gets alone (the old whole-card meaning took the fifth out of it)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    folder = str(tiny_hf("llama-gqa"))

    def pool_bytes() -> int:
        out = subprocess.run([sys.executable, "-c", POOL_CHILD, folder], capture_output=True, text=True, timeout=120,
                             env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return int(out.stdout.strip().splitlines()[-1])

    gc.collect()
    torch.cuda.empty_cache()
    alone = pool_bytes()
    fifth = torch.cuda.mem_get_info()[1] // 5
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(fifth)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        shared = pool_bytes()
    finally:
        holder.kill()
        holder.wait(30)
    assert shared >= alone - 512 * 2**20, f"{shared} bytes beside a holder of {fifth}, {alone} alone"


def test_the_kv_pool_leaves_room_for_sampling_a_full_batch(model) -> None:
    """Sampling runs on the GPU: the pool of an engine that may sample 16,384 sequences at once is smaller by
    at least four float32 copies of their logits (a top_p step sorts each row in full and sums its CDF)."""
    sizes = {}
    for rows in (1, 16384):
        gc.collect()
        torch.cuda.empty_cache()
        engine = Engine(model, None, EngineConfig(device="cuda", gpu_memory_utilization=0.3, max_num_seqs=rows,
                                                  max_num_batched_tokens=16384, cuda_graphs=False))
        sizes[rows] = engine.cache.nbytes
        del engine
    assert sizes[1] - sizes[16384] >= 16384 * model.cfg.vocab_size * 4 * 4


def test_seeded_sampling_on_cuda_is_batch_invariant(model) -> None:
    """Each sampled row draws with one uniform from the request's own generator, so a seeded request gives
    the same tokens alone and in a batch, graphs or not."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
    alone = {}
    for i in range(3):
        engine = _engine(model, cuda_graphs=False)
        engine.add_request(str(i), PROMPTS[i], params(i))
        alone.update(token_ids(run_to_completion(engine)))
    engine = _engine(model)
    for i in range(3):
        engine.add_request(str(i), PROMPTS[i], params(i))
    assert token_ids(run_to_completion(engine)) == alone


def test_the_benchmarks_step_breakdown_times_the_graphs_on_the_gpu(model) -> None:
    """What ``epd bench engine --device cuda`` prints under its batch-1 row: the graph's device time (CUDA
    events around each replay) is part of the step's wall time, and the timing stops afterwards."""
    from bench.gpu_engine_bench import step_breakdown

    engine = _engine(model)
    line = step_breakdown(engine, model.cfg.vocab_size, 8, roofline=1e6)
    assert line is not None and line.startswith("batch-1 step "), line
    step_us = float(line.split()[2])
    graph_us = float(line.split(" its graph ")[1].split()[0])
    assert 0 < graph_us <= step_us, line
    assert engine.graphs is not None and engine.graphs.replay_events is None
    assert_no_leaks(engine)


def test_prefix_cache_hits_give_the_tokens_of_an_engine_without_it(model) -> None:
    """Prompts sharing a 40-token prefix, one after another: each later one starts from two cached blocks
    (the Triton prefill over cached context), decoding in graphs, with the tokens of a fresh engine
    without the cache."""
    shared = [(7 * i) % 300 + 3 for i in range(40)]
    reqs = [(shared + [11 + i, 23, 5 + i], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
            for i in range(4)]
    want = run_alone(lambda: _engine(model, prefix_caching=False, cuda_graphs=False), reqs)
    engine = _engine(model)
    got: dict[str, list[int]] = {}
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(str(i), prompt, params)
        got.update(token_ids(run_to_completion(engine)))
    assert got == want
    assert engine.stats().prefix_cache_hits == 3 * 2 * engine.cache.block_size
    assert_no_leaks(engine)
