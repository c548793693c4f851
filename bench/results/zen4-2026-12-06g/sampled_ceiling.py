"""At T = 1, how many tokens a pass a drafter as good as the target itself could expect.

Exact verification accepts a one-hot draft token with the target's probability of it (after the
tokens before it were accepted), so a draft chain g_1..g_k from a prefix is accepted to depth
E = sum_j prod_{l <= j} p(g_l | prefix, g_<l) in expectation. Here the chain is the target's own
most likely continuation, token by token, from every position of the default's sampled (T = 1)
texts of a `bench_grounded` run: what a free drafter that knows the target's distributions, but
not its random draws, would offer (no copy drafter does better on average). Then a walk over each
text: from position i, depth j accepted with those probabilities, i advances j + 1; 400 walks a
text, the mean number of passes, against the default's served iterations and one pass a token.

One pass over prompt + text, then k passes of one row per text position (each row sees its own
prefix and its own chain: a 4D mask), on the int8 default target; ~2 min for 14 texts. Run from
the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06g/sampled_ceiling.py \
        bench/results/zen4-2026-12-06g/grounded-2rounds/results.json
"""

import json
import random
import statistics
import sys

import torch
from transformers import AutoTokenizer, DynamicCache

from bench.bench_grounded import load_hf_target
from bench.grounded_prompts import grounded_items, prompt_ids
from specdec.models import resolve_model
from specdec.runtime.kv import additive_mask

DEPTH = 10
WALKS = 400


def chain_probabilities(model, prompt: list[int], text: list[int]) -> list[list[float]]:
    """Per text position i, the probabilities of the target's greedy chain of DEPTH tokens after
    prompt + text[:i]."""
    n, start = len(text), len(prompt)
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt + text])
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, start - 1:start - 1 + n]
    chains: list[list[float]] = [[] for _ in range(n)]
    for step in range(DEPTH):
        probs = torch.softmax(logits.float(), dim=-1)
        top, token = probs.max(dim=-1)
        for i in range(n):
            chains[i].append(float(top[i]))
        if step == DEPTH - 1:
            break
        length = start + n + n * step
        allowed = torch.zeros((n, length + n), dtype=torch.bool)
        for i in range(n):
            allowed[i, :start + i] = True
            allowed[i, [start + n + n * t + i for t in range(step + 1)]] = True
        positions = torch.tensor([[start + i + step for i in range(n)]])
        mask = additive_mask(allowed, torch.float32)[None, None]
        logits = model(input_ids=token[None], attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[0]
    return chains


def walk_passes(chains: list[list[float]], rng: random.Random) -> int:
    position, passes = 0, 0
    while position < len(chains):
        depth = 0
        while depth < DEPTH and rng.random() < chains[position][depth]:
            depth += 1
        position += min(depth + 1, len(chains) - position)
        passes += 1
    return passes


def main(path: str) -> None:
    run = json.load(open(path))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(run["meta"]["target"]))
    items = {item.id: item for item in grounded_items(run["meta"]["per_kind"])}
    limit = run["meta"].get("max_prompt_tokens", 1024)
    model = load_hf_target(resolve_model(run["meta"]["target"]), "int8", 2).model
    rng = random.Random(0)
    print(f"{'prompt':24} {'round':>5} {'tokens':>6} {'served':>7} {'target-as-drafter':>18}"
          f" {'mean p(greedy)':>15}")
    served_total = walk_total = tokens_total = 0.0
    for row in run["details"]:
        if row["config"] != "specdec" or row["temperature"] != 1 or row["item"] not in items:
            continue
        prompt, text = prompt_ids(items[row["item"]], tokenizer, limit), row["token_ids"]
        if isinstance(text, str):
            text = json.loads(text)
        with torch.inference_mode():
            chains = chain_probabilities(model, prompt, text)
        walks = statistics.mean(walk_passes(chains, rng) for _ in range(WALKS))
        served_total += row["iterations"]
        walk_total += walks
        tokens_total += len(text)
        print(f"{row['item']:24} {row['round']:>5} {len(text):>6} {row['iterations']:>7} {walks:>18.1f}"
              f" {statistics.mean(chain[0] for chain in chains):>15.2f}", flush=True)
    print(f"{'all':24} {'':>5} {tokens_total:>6.0f} {served_total:>7.0f} {walk_total:>18.1f}")
    print(f"tokens a pass: plain 1.00, served {tokens_total / served_total:.2f}, "
          f"target as drafter (depth {DEPTH}) {tokens_total / walk_total:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
