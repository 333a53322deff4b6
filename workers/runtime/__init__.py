"""The torch engine shared by the encode, prefill and decode workers.

Modules, bottom up:
  errors        typed errors that every layer above maps to a status (HTTP 4xx, gRPC code)
  config        ModelConfig parsed and validated from a Hugging Face config.json
  rope          rotary embeddings, including Llama-3 frequency scaling
  kv_cache      block allocator and per-layer paged KV storage (dense or quantised)
  attention     per-step attention metadata and paged attention over the cache
  model         the Llama/Qwen2 decoder
  vision        CLIP-style ViT encoder plus LLaVA projector (the encode stage)
  tokenizer     tokenizers-based tokenizer, chat template, incremental detokenizer
  loader        reads HF checkpoint folders (config, safetensors shards, tokenizer, generation config)
  default_model deterministic demo model (random weights) written as an HF folder
  sampler       greedy / temperature / top-k / top-p with per-request seeds
  sequence      per-request state machine
  scheduler     admission, chunked prefill, continuous batching, preemption
  engine        the step loop tying them together
  generate      single-process reference generate(): the oracle for the disaggregated path
"""
