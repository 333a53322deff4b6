"""Per-step attention metadata and paged attention over the KV cache.

One engine step runs every scheduled token through the model as one flat batch of ``T`` tokens:
first one token per decoding sequence, then the prefill chunks back to back. ``StepBatch`` says
where each token sits (position, cache slot) and which cached slots each query attends to. It
is built once per step and shared by all layers.

Two ways to read the cache: the torch path gathers each sequence's slots into a dense copy
(``decode_slots`` / ``gather_slots``; the CPU implementation and the reference), and the kernel path
(``StepBatch.kernel``) hands block tables and lengths to the Triton kernels, which read the cache in
place. Fresh prompts take SDPA over their own k/v either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.runtime.kv_cache import KVLayerStorage, PagedKVCache


@dataclass(frozen=True)
class DecodeItem:
    """One decoding sequence: its newest token, at ``position``, attends to positions [0, position]."""

    token_id: int
    position: int
    block_table: list[int]


@dataclass(frozen=True)
class PrefillItem:
    """A chunk of a sequence's prompt: tokens at positions [start, start + len(token_ids))."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    want_logits: bool
    # (offset within this chunk, embedding row) for multimodal placeholder tokens
    embed_offsets: list[int] | None = None
    embeds: torch.Tensor | None = None
    # the logits of this chunk's first n positions too (prompt logprobs), after every sampled row's
    prompt_logits: int = 0


@dataclass(frozen=True)
class PrefillSlice:
    token_start: int  # index into the flat batch
    token_end: int
    context_len: int  # tokens already in the cache before this chunk
    gather_slots: torch.Tensor | None  # slots of positions [0, context_len + n) when context_len > 0
    mask: torch.Tensor | None  # [n, context_len + n] bool, True = attend


PREFILL_BLOCK_M = 16  # query tokens per prefill tile of the kernel path


@dataclass(frozen=True)
class PrefillTiles:
    """Prompt tokens cut into tiles of at most ``PREFILL_BLOCK_M`` tokens of one sequence, as int32
    device tensors [num_tiles]: the sequence's row in the block tables, the tile's first token in the
    flat batch, its token count, and the first token's position in the sequence."""

    seq: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor
    pos0: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.seq.shape[0]


def make_prefill_tiles(chunks: list[tuple[int, int, int, int]], device: torch.device) -> PrefillTiles:
    """Tiles for chunks given as (block-table row, first token in the flat batch, tokens, first position)."""
    cols: list[list[int]] = [[], [], [], []]
    for row, start, n, pos in chunks:
        for off in range(0, n, PREFILL_BLOCK_M):
            for col, value in zip(cols, (row, start + off, min(PREFILL_BLOCK_M, n - off), pos + off)):
                col.append(value)
    t = torch.tensor(cols, dtype=torch.int32).to(device)
    return PrefillTiles(t[0], t[1], t[2], t[3])


@dataclass(frozen=True)
class KernelMeta:
    """What the paged kernels read the cache through, all on the cache's device.

    block_tables: [rows, max_blocks] int32, one row per decoding sequence (first ``num_decode`` rows)
    then one per prefill chunk with cached context; decode_lens: [num_decode] int32 tokens each decode
    attends to (0 = a padded slot); tiles: the context chunks' query tiles, or None; max_context: a
    bound on ``decode_lens`` known to the host (it picks how decode attention splits the context)."""

    block_tables: torch.Tensor
    decode_lens: torch.Tensor
    tiles: PrefillTiles | None
    max_context: int = 0


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]: where each token's k/v is written
    num_decode: int
    decode_slots: torch.Tensor | None  # [num_decode, L]
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, L]
    prefills: tuple[PrefillSlice, ...]
    logits_indices: torch.Tensor  # [S]: rows whose logits the step returns (the sampled ones)
    embed_indices: torch.Tensor | None  # [M]: rows whose embedding is replaced
    embeds: torch.Tensor | None  # [M, hidden]
    kernel: KernelMeta | None = None  # set (and the gather fields None) for the kernel path
    # [P]: more rows whose logits the step returns, after the S (PrefillItem.prompt_logits, in item order)
    prompt_logits_indices: torch.Tensor | None = None

    def logit_rows(self) -> torch.Tensor:
        """Every row whose logits the step returns: the sampled ones, then the prompt logprobs' ones."""
        if self.prompt_logits_indices is None:
            return self.logits_indices
        return torch.cat((self.logits_indices, self.prompt_logits_indices))


def slot_list(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slot indices of tokens [start, end) of a sequence with this block table, as ints: one C-level
    ``range`` per block touched, since building tensors to compute the same short list costs more than the
    list itself, once per prefill per step."""
    out: list[int] = []
    pos = start
    while pos < end:
        block, off = divmod(pos, block_size)
        take = min(block_size - off, end - pos)
        base = block_table[block] * block_size + off
        out.extend(range(base, base + take))
        pos += take
    return out


def _block_rows(tables: list[list[int]], lengths: list[int], bs: int) -> torch.Tensor:
    """[rows, max_blocks] int32: each table cut to the blocks its length uses, zero-padded."""
    width = max(1, max(-(-n // bs) for n in lengths))
    rows = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
    return torch.tensor(rows, dtype=torch.int32)


def build_step_batch(decodes: list[DecodeItem], prefills: list[PrefillItem], cache: PagedKVCache,
                     paged_kernels: bool = False) -> StepBatch:
    """The step's metadata; ``paged_kernels`` builds ``kernel`` for the Triton path instead of the
    gather indices of the torch path."""
    device = cache.device
    bs = cache.block_size
    ids: list[int] = [d.token_id for d in decodes]
    positions: list[int] = [d.position for d in decodes]
    slots: list[int] = [d.block_table[d.position // bs] * bs + d.position % bs for d in decodes]
    logits_rows: list[int] = list(range(len(decodes)))

    decode_slots = decode_mask = None
    if decodes and not paged_kernels:
        max_len = max(d.position for d in decodes) + 1
        max_blocks = -(-max_len // bs)
        tables = torch.tensor([d.block_table[:max_blocks] + [0] * (max_blocks - len(d.block_table[:max_blocks]))
                               for d in decodes], dtype=torch.long)
        decode_slots = (tables[:, :, None] * bs + torch.arange(bs)).view(len(decodes), -1)[:, :max_len]
        lengths = torch.tensor([d.position + 1 for d in decodes])
        valid = torch.arange(max_len)[None, :] < lengths[:, None]
        # A row's positions past its end are masked, but a masked score times a NaN value is still NaN: they
        # read the row's own first slot, never block 0 (the padding) or the stale tail of its last block,
        # which may hold another request's NaN or inf.
        decode_slots = torch.where(valid, decode_slots, decode_slots[:, :1])
        decode_slots, decode_mask = decode_slots.to(device), valid[:, None, None, :].to(device)

    slices: list[PrefillSlice] = []
    ctx_tables: list[list[int]] = []
    ctx_lengths: list[int] = []
    ctx_chunks: list[tuple[int, int, int, int]] = []
    embed_rows: list[int] = []
    embed_parts: list[torch.Tensor] = []
    prompt_rows: list[int] = []
    for p in prefills:
        n = len(p.token_ids)
        first = len(ids)
        ids.extend(p.token_ids)
        positions.extend(range(p.start, p.start + n))
        slots.extend(slot_list(p.block_table, p.start, p.start + n, bs))
        gather = mask = None
        if p.start > 0 and paged_kernels:
            ctx_chunks.append((len(decodes) + len(ctx_tables), first, n, p.start))
            ctx_tables.append(p.block_table)
            ctx_lengths.append(p.start + n)
        elif p.start > 0:
            total = p.start + n
            gather = cache.slots_for(p.block_table, 0, total)
            q_pos = torch.arange(p.start, total)[:, None]
            mask = (torch.arange(total)[None, :] <= q_pos).to(device)
        slices.append(PrefillSlice(first, first + n, p.start, gather, mask))
        if p.want_logits:
            logits_rows.append(first + n - 1)
        prompt_rows.extend(range(first, first + min(p.prompt_logits, n)))
        if p.embed_offsets:
            assert p.embeds is not None, "embed_offsets come with their embeds"
            embed_rows.extend(first + o for o in p.embed_offsets)
            embed_parts.append(p.embeds)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    kernel = None
    if paged_kernels and (decodes or ctx_chunks):
        decode_lens = [d.position + 1 for d in decodes]
        tables = _block_rows([d.block_table for d in decodes] + ctx_tables, decode_lens + ctx_lengths, bs)
        kernel = KernelMeta(tables.to(device), torch.tensor(decode_lens, dtype=torch.int32).to(device),
                            make_prefill_tiles(ctx_chunks, device) if ctx_chunks else None,
                            max(decode_lens, default=0))

    return StepBatch(
        input_ids=t(ids), positions=t(positions), slot_mapping=t(slots), num_decode=len(decodes),
        decode_slots=decode_slots, decode_mask=decode_mask, prefills=tuple(slices),
        logits_indices=t(logits_rows),
        embed_indices=t(embed_rows) if embed_rows else None,
        embeds=torch.cat(embed_parts).to(device) if embed_parts else None, kernel=kernel,
        prompt_logits_indices=t(prompt_rows) if prompt_rows else None,
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                    storage: KVLayerStorage, scale: float) -> torch.Tensor:
    """Attention for every token of the step. q: [T, H, D]; k, v: [T, Hkv, D] (this step's, already
    written to ``storage``). Returns [T, H, D]."""
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        assert batch.decode_slots is not None
        length = batch.decode_slots.shape[1]
        kc, vc = storage.gather(batch.decode_slots.reshape(-1), q.dtype)
        kc = kc.view(nd, length, *kc.shape[1:]).transpose(1, 2)
        vc = vc.view(nd, length, *vc.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kc, vc, attn_mask=batch.decode_mask,
                                           scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for p in batch.prefills:
        qs = q[p.token_start:p.token_end].transpose(0, 1).unsqueeze(0)
        if p.context_len == 0:
            # Fresh sequence: its own k/v are the whole context; the causal kernel needs no gather.
            ks = k[p.token_start:p.token_end].transpose(0, 1).unsqueeze(0)
            vs = v[p.token_start:p.token_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            assert p.gather_slots is not None
            kc, vc = storage.gather(p.gather_slots, q.dtype)
            o = F.scaled_dot_product_attention(qs, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0),
                                               attn_mask=p.mask, scale=scale, enable_gqa=True)
        out[p.token_start:p.token_end] = o[0].transpose(0, 1)
    return out
