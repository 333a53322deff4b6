"""A prefill engine and a decode engine joined by a real KV transfer on loopback, in one process.

It is the smallest disaggregated deployment: the prefill side streams each request's KV layer by
layer over gRPC (or shared memory) into blocks the decode side reserved, then decode continues.
Tests and benchmarks use it to compare the disaggregated path with ``generate()`` and to measure
the transfer; the real pools (issue 4) run the two sides in separate processes.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.cuda_ipc import IpcPool
from kvtransfer.receiver import KVReceiver, TransferOutcome
from kvtransfer.sender import KVSender, TransportChoice
from kvtransfer.server import kv_transfer_handler, start_server
from kvtransfer.stream import PushResult
from workers.decode.kv_sink import CacheSink, KVStore, decode_cache_dtypes
from workers.prefill.kv_stream import LayerStreamer, engine_layout
from workers.runtime.engine import DTYPES, Engine, EngineConfig
from workers.runtime.loader import LoadedModel
from workers.runtime.model import DecoderModel
from workers.runtime.sampler import SamplingParams
from workers.service_base import first_logprobs, logprobs_of_first


@dataclass(frozen=True)
class PairResult:
    token_ids: list[int]
    logits: list  # per output token, float32 [vocab], when the params asked for return_logits
    push: PushResult
    ttft_s: float  # add to prefill engine -> first token admitted on the decode side
    logprobs: list = field(default_factory=list)  # per output token, when the params asked for logprobs


class DisaggPair:
    def __init__(self, bundle: LoadedModel, codecs: tuple[str, ...], *, prefill: EngineConfig = EngineConfig(),
                 decode: EngineConfig = EngineConfig(), store: KVStore = "dequantize",
                 transport: TransportChoice = "grpc", timeout_s: float = 30.0,
                 device_path: bool | None = None) -> None:
        """Each side runs on its config's ``device`` (the bundle's model, or a copy of it moved there
        when the two sides differ, e.g. a CUDA prefill feeding a CPU decode). ``device_path``: each side's
        device path (``LayerStreamer(from_cache=...)``, ``CacheSink(staged=...)``); None takes it for a
        cache off the CPU, True on CPU caches too (tests)."""
        self.bundle = bundle
        self.timeout_s = timeout_s
        self.security = TransferSecurity(token=secrets.token_urlsafe(24))
        self.prefill = Engine(model_on_device(bundle.model, prefill.device, prefill.dtype), bundle.tokenizer, prefill,
                              bundle.eos_token_ids)
        layer_dtypes = decode_cache_dtypes(codecs, decode.dtype, store)
        self.decode = Engine(model_on_device(bundle.model, decode.device, decode.dtype), bundle.tokenizer,
                             EngineConfig(**{**decode.__dict__, "kv_layer_dtypes": layer_dtypes}),
                             bundle.eos_token_ids)
        self.receiver = KVReceiver(engine_layout(self.decode, codecs), CacheSink(self.decode.cache, device_path))
        self.receiver.start_janitor()
        if transport != "grpc":  # tcp pushes, and shm pushes' control messages, use the bulk connection
            self.receiver.enable_bulk("127.0.0.1")
        if transport == "cuda_ipc" or (transport == "auto" and self.decode.cache.device.type == "cuda"):
            # on a CPU cache the pool is host memory: the transport's logic, tested without a GPU
            self.receiver.enable_cuda_ipc(IpcPool(self.decode.cache.device, segment_bytes=64 * 2**20))
        self.server, port = start_server([kv_transfer_handler(self.receiver)], "127.0.0.1:0", self.security)
        self.target = f"127.0.0.1:{port}"
        self.sender = KVSender(self.security, transport=transport, device=self.prefill.cache.device)
        self.streamer = LayerStreamer(self.prefill, self.sender, codecs, from_cache=device_path)

    def close(self) -> None:
        self.streamer.close()
        self.sender.close()  # channels first, so the server's shutdown does not GOAWAY live connections
        self.server.stop(0)
        self.receiver.stop()

    def __enter__(self) -> DisaggPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[PairResult]:
        """Prefill every prompt (batched), transfer, then decode them all (batched). ``params`` is one
        for all prompts or one per prompt."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        outcomes: dict[str, TransferOutcome] = {}
        done = threading.Condition()
        reservations = {}
        starts = {}

        def on_done(outcome: TransferOutcome) -> None:
            with done:
                outcomes[outcome.request_id] = outcome
                done.notify_all()

        try:
            for i, prompt in enumerate(prompts):
                rid = f"req-{i}"
                reservations[rid] = self.decode.reserve(rid, len(prompt))
                self.receiver.expect(rid, reservations[rid].blocks, on_done, self.timeout_s)
                self.streamer.start(rid, self.target, len(prompt), self.timeout_s)
                starts[rid] = time.perf_counter()
                self.prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                                     logprobs=per_prompt[i].logprobs,
                                                                     prompt_logprobs=per_prompt[i].prompt_logprobs))
        except BaseException:  # a push that could not open: nothing of this run stays held, on either side
            for rid, reservation in reservations.items():
                self.prefill.abort(rid)
                self.streamer.cancel(rid, "a push of the run did not open")
                self.receiver.cancel(rid, "a push of the run did not open")
                self.decode.release(reservation)
            raise
        # finish each stream as soon as its prompt is done, off the engine thread, as a prefill worker does
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-finish") as pool:
            futures = {}
            while self.prefill.has_unfinished():
                for out in self.prefill.step():
                    futures[out.request_id] = pool.submit(self.streamer.finish, out.request_id, out.new_token_ids[0],
                                                          first_logprobs(out.logprobs))
            pushes = {rid: f.result() for rid, f in futures.items()}
        with done:
            done.wait_for(lambda: len(outcomes) == len(prompts), timeout=self.timeout_s)
        tokens: dict[str, list[int]] = {}
        logits: dict[str, list] = {}
        logprobs: dict[str, list] = {}
        ttft: dict[str, float] = {}
        for i, prompt in enumerate(prompts):
            rid = f"req-{i}"
            outcome = outcomes.get(rid)
            if outcome is None or not outcome.ok or outcome.first_token is None:
                self.decode.release(reservations[rid])
                raise RuntimeError(f"transfer of {rid} failed: {outcome}")
            first = self.decode.add_prefilled(reservations[rid], prompt, outcome.first_token, per_prompt[i],
                                              logprobs_of_first(outcome.first_logprobs))
            ttft[rid] = time.perf_counter() - starts[rid]
            tokens[rid] = list(first.new_token_ids)
            logits[rid] = [None]  # the first token's logits live on the prefill side
            logprobs[rid] = [first.logprobs]
        while self.decode.has_unfinished():
            for out in self.decode.step():
                tokens[out.request_id].extend(out.new_token_ids)
                logits[out.request_id].append(out.logits)
                logprobs[out.request_id].append(out.logprobs)
        return [PairResult(tokens[f"req-{i}"], logits[f"req-{i}"], pushes[f"req-{i}"], ttft[f"req-{i}"],
                           logprobs[f"req-{i}"]) for i in range(len(prompts))]


def model_on_device(model: DecoderModel, device: str, dtype: str | None = None) -> DecoderModel:
    """``model`` itself when it is on ``device`` in ``dtype`` (None: its own), else a copy there (the
    original stays put, so the other side keeps its weights where they are)."""
    target = torch.device(device)
    want = model.dtype if dtype is None else DTYPES[dtype]
    same_device = model.device.type == target.type and (target.index is None or model.device == target)
    if same_device and want == model.dtype:
        return model
    moved = DecoderModel(model.cfg, want, target)
    moved.load_state_dict(model.state_dict())
    return moved
