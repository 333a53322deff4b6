"""Tiny random checkpoints written by transformers itself, with a tokenizer and a chat template, as an
operator would download them: a text-only Llama / Qwen2 (``write_text_model``) and a LLaVA with a CLIP tower
(``write_llava``, with its processor: preprocessor_config.json, processor_config.json, chat template).

The weights are random but not flat (unit-scale embeddings, unit-gain projections), so greedy output depends on
the whole context (image included) and a wrong KV cache or a wrong image embedding changes the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from workers.runtime.default_model import BOS, EOS, IM_END, IMAGE, PAD, build_tokenizer

TEXT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# LLaVA 1.5's template (as on the Hub), with this tokenizer's image token
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for item in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<|image|>\n' }}{% endfor %}{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ item['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
TEXT: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
VISION: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=56, patch_size=14, hidden_act="quick_gelu")


def hf_tokenizer():
    """The demo model's BPE tokenizer as a transformers tokenizer (special tokens named)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), bos_token=BOS, eos_token=IM_END,
                                   pad_token=PAD, unk_token=None)


def _text_config(arch: str, vocab_size: int, tok):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return cls(vocab_size=vocab_size, bos_token_id=tok.convert_tokens_to_ids(BOS),
               eos_token_id=[tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(EOS)],
               tie_word_embeddings=False, **TEXT)


def _spread(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale embeddings and heads, unit-gain projections (1/sqrt(fan_in)), non-zero q/k/v and projector
    biases, from ``seed``: HF's 0.02 init leaves the context (and the image) almost no say in the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("weight") and p.dim() >= 2:  # every projection, at unit gain
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            elif name.endswith("bias") and ("self_attn" in name or "projector" in name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def write_text_model(folder: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A text-only ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` folder with tokenizer and chat template."""
    import transformers

    tok = hf_tokenizer()
    tok.chat_template = TEXT_CHAT_TEMPLATE
    config = _text_config(arch, len(tok), tok)
    torch.manual_seed(seed)
    model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM)(config)
    _spread(model, seed)
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_llava(folder: Path, text_arch: str = "llama", seed: int = 0,
                strategy: Literal["default", "full"] = "default",
                vision_feature_layer: int | list[int] = -2, max_shard_size: str | None = None) -> Path:
    """A ``LlavaForConditionalGeneration`` folder: CLIP tower, projector, Llama/Qwen2 language model,
    tokenizer and LlavaProcessor (CLIP image processor, chat template), as transformers saves them."""
    import transformers

    tok = hf_tokenizer()
    image_id = tok.convert_tokens_to_ids(IMAGE)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION), text_config=_text_config(text_arch, len(tok), tok),
        image_token_index=image_id, vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=strategy, projector_hidden_act="gelu",
        image_seq_length=(VISION["image_size"] // VISION["patch_size"]) ** 2 + (strategy == "full"))
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    _spread(model, seed)
    model.eval().save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    size = VISION["image_size"]
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                                      crop_size={"height": size, "width": size})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=VISION["patch_size"],
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1, image_token=IMAGE,
        chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder
