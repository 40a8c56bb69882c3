"""The serving check's tiny model, loaded by transformers on CPU (run with an engine's Python).

    model_cpu.py DIR    prints one JSON object

What it reports: the config and tokenizer as the engines' loaders read them, a text's round trip
through the tokenizer, greedy decodes of the check's prompts done twice (the same ids each time),
once more with the prompt's first 304 tokens' KV computed alone and the rest decoded on top (the
shape a prefix that comes back from a cache is computed in), and once with that prefix KV taken
from another prompt (what a wrong load would feed the model).
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hack.serve_check import prompts

PREFIX = 304  # 19 blocks of 16: what a cache would hold of a 320-token prompt


def main() -> None:
    d = sys.argv[1]
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    text = "the pool serves a prefix"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    measured = prompts(config.vocab_size, 4, 320, 0, avoid=[config.bos_token_id, config.eos_token_id])

    def greedy(p: list[int], past=None) -> list[int]:
        x = torch.tensor([p])
        out = model.generate(x, past_key_values=past, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        return out[0, len(p) :].tolist()

    def prefix_kv(p: list[int]):
        with torch.no_grad():
            return model(torch.tensor([p[:PREFIX]]), use_cache=True).past_key_values

    with torch.no_grad():
        first = [greedy(p) for p in measured]
        second = [greedy(p) for p in measured]
        cached = [greedy(p, prefix_kv(p)) for p in measured]
        wrong = [greedy(p, prefix_kv(measured[(i + 1) % len(measured)])) for i, p in enumerate(measured)]
    print(
        json.dumps(
            {
                "architectures": config.architectures,
                "model_type": config.model_type,
                "vocab_size": config.vocab_size,
                "tokenizer_len": len(tok),
                "bos": [config.bos_token_id, tok.bos_token_id],
                "eos": [config.eos_token_id, tok.eos_token_id],
                "round_trip": tok.decode(ids),
                "text": text,
                "first": first,
                "second": second,
                "cached": cached,
                "wrong": wrong,
                "dtype": str(next(model.parameters()).dtype),
            }
        )
    )


if __name__ == "__main__":
    main()
