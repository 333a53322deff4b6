"""``detokenizer``: turning a streamed answer's ids into text, per token, at 512 and 8,192 output tokens,
against Hugging Face tokenizers' own streaming decoder (``tokenizers.decoders.DecodeStream``).

The figure is ``workers.runtime.tokenizer.IncrementalDetokenizer`` as the engine runs it for every token
of every sequence, under its lock: primed with the prompt's last ids, no stop strings. The reference is
``DecodeStream.step`` on the same tokenizer and ids, which keeps a few ids of context as vLLM does. A
detokenizer that decoded the whole output at each token would cost in proportion to the output's length:
the 8,192-token figure would then be about sixteen times the 512-token one. Figures are microseconds per
token over the whole answer, on the --clock, with the built-in demo model's byte-level BPE tokenizer.
"""

from __future__ import annotations

from bench.micro.results import Result
from bench.micro.timing import Plan, paired, seconds_of

LENGTHS = (512, 8192)
TEXT = ("Serving systems split every request into stages: encode, prefill and decode. Große Ströme, "
        "日本語のテキスト, emoji 🎉 and numbers 3.14159 all stream through the same detokenizer.\n")


def run(plan: Plan) -> list[Result]:
    from tokenizers.decoders import DecodeStream

    from workers.runtime.default_model import ensure_default_checkpoint
    from workers.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer.from_folder(ensure_default_checkpoint())
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    out = []
    for length in LENGTHS[:1] if plan.quick else LENGTHS:
        ids = (text_ids * (length // len(text_ids) + 1))[:length]
        prompt = text_ids[:5]

        def ours() -> str:
            detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
            return "".join(detok.add(i).text for i in ids) + detok.flush()

        def stream() -> str:
            decoder = DecodeStream(skip_special_tokens=True)
            return "".join(decoder.step(tok.backend, i) or "" for i in ids)

        whole = tok.decode(ids)
        if ours() != whole or stream() != whole:  # warm-up, and a check that both give the answer's text
            raise RuntimeError("a detokenizer's text differs from decoding the whole answer")
        figs, refs = paired(seconds_of(ours, plan.timer), seconds_of(stream, plan.timer), plan)
        per_token = [s / length * 1e6 for s in figs], [s / length * 1e6 for s in refs]
        out.append(Result(f"detokenizer.t{length}", "detokenizer", "us", "lower",
                          "tokenizers' DecodeStream on the same ids", tuple(per_token[0]), tuple(per_token[1]),
                          note=f"{length} output tokens, per token; demo byte-level BPE; {plan.clock} clock"))
    return out
