"""How many verify passes model-free drafting could save on the grounded prompts: a ceiling.

Over the greedy (T = 0) texts of a `bench_grounded` run (identical for HF prompt lookup and specdec
there, since both run our int8 model), per prompt:
  - specdec's served iterations (the run's record);
  - HF prompt lookup's passes, replayed with transformers' rule (PromptLookupCandidateGenerator:
    the first earlier occurrence of the last 2, else 1, tokens, its next 10 tokens);
  - the copy oracle: at every step the longest continuation copied from ANY earlier position whose
    preceding token is the text's last one (perfect choice among all matches; capped at 10 or 16
    tokens a pass). No drafter that copies spans of the prompt and output can need fewer passes.
A pass emits the accepted draft tokens plus one. No model runs; a second.

    PYTHONPATH=. python bench/results/zen4-2026-12-06f/draft_ceiling.py \
        bench/results/zen4-2026-12-06e/grounded-2rounds/results.json
"""

import json
import sys

from transformers import AutoTokenizer

from bench.grounded_prompts import grounded_items, prompt_ids
from specdec.models import resolve_model


def accepted(draft: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def hf_lookup_draft(ids: list[int], max_ngram: int = 2, tokens: int = 10) -> list[int]:
    length = len(ids)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = ids[-n:]
        for start in range(length - n + 1):
            if ids[start:start + n] == tail and start + n < length:
                return ids[start + n:min(start + n + tokens, length)]
    return []


def oracle_draft(ids: list[int], truth: list[int], cap: int) -> list[int]:
    best: list[int] = []
    last = ids[-1]
    for j in range(1, len(ids)):
        if ids[j - 1] == last:
            run = ids[j:j + cap]
            if accepted(run, truth) > accepted(best, truth):
                best = run
    return best


def passes(prompt: list[int], output: list[int], propose) -> int:
    ids, done, count = list(prompt), 0, 0
    while done < len(output):
        truth = output[done:]
        step = min(accepted(propose(ids, truth), truth) + 1, len(truth))
        ids += output[done:done + step]
        done += step
        count += 1
    return count


def columns(counts: list[int]) -> str:
    return " ".join(f"{count:>{width}}" for count, width in zip(counts, (8, 10, 10, 10), strict=True))


def main(path: str) -> None:
    run = json.load(open(path))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(run["meta"]["target"]))
    items = {item.id: item for item in grounded_items(run["meta"]["per_kind"])}
    limit = run["meta"].get("max_prompt_tokens", 1024)
    print(f"{'prompt':24} {'round':>5} {'specdec':>8} {'HF lookup':>10} {'oracle/10':>10} {'oracle/16':>10}")
    totals = [0, 0, 0, 0]
    for row in run["details"]:
        if row["config"] != "specdec" or row["temperature"] != 0 or row["item"] not in items:
            continue
        prompt, output = prompt_ids(items[row["item"]], tokenizer, limit), row["token_ids"]
        counts = [row["iterations"], passes(prompt, output, lambda ids, truth: hf_lookup_draft(ids)),
                  passes(prompt, output, lambda ids, truth: oracle_draft(ids, truth, 10)),
                  passes(prompt, output, lambda ids, truth: oracle_draft(ids, truth, 16))]
        totals = [a + b for a, b in zip(totals, counts, strict=True)]
        print(f"{row['item']:24} {row['round']:>5} " + columns(counts))
    print(f"{'all':24} {'':>5} " + columns(totals))
    names = ("HF lookup", "oracle/10", "oracle/16")
    shares = ", ".join(f"{name} {total / totals[0]:.2f}"
                       for name, total in zip(names, totals[1:], strict=True))
    print(f"passes against specdec's: {shares}")


if __name__ == "__main__":
    main(sys.argv[1])
