"""Whether the configurations of a benchmark run wrote the same greedy text.

At T = 0 every specdec configuration emits its target's greedy continuation (lossless), so their
texts must agree token for token. Plain HF's rows need not: torch.ao's per-tensor int8 quantises a
pass's activations with one scale for all its rows, so its text is another model's, and its prompt
lookup's text another again (a verify pass of 11 rows has other scales than a decode step of one).
A tok/s ratio between two configurations is a like-for-like speed only where their texts agree:
a model-free draft's acceptance is a property of the text it drafts for.

The reference is the target-only row of the same prompt and round where the run has one, else
specdec's (both are the target's greedy text).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

REFERENCES = ("target-only", "specdec", "drafter-none")


def agreed_prefix(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """How many leading tokens `tokens` shares with `reference`."""
    for index, (token, expected) in enumerate(zip(tokens, reference, strict=False)):
        if token != expected:
            return index
    return min(len(tokens), len(reference))


def agreement(details: list[dict[str, Any]], configs: Sequence[str]) -> dict[str, Any] | None:
    """Per configuration, over the T = 0 runs with token ids: runs compared, runs whose text is the
    reference's whole, and the median of their agreed prefixes (None: no reference config ran)."""
    reference = next((config for config in REFERENCES if config in configs), None)
    greedy = [d for d in details if d["temperature"] == 0 and "token_ids" in d]
    if reference is None or not greedy:
        return None
    expected = {(d["round"], d["item"]): d["token_ids"] for d in greedy if d["config"] == reference}
    prefixes: dict[str, list[int]] = defaultdict(list)
    whole: dict[str, int] = defaultdict(int)
    for d in greedy:
        text = expected.get((d["round"], d["item"]))
        if text is None or d["config"] == reference:
            continue
        prefix = agreed_prefix(d["token_ids"], text)
        prefixes[d["config"]].append(prefix)
        whole[d["config"]] += prefix == len(text) == len(d["token_ids"])
    return {"reference": reference,
            "configs": {config: {"runs": len(values), "identical": whole[config],
                                 "median_prefix": statistics.median(values)}
                        for config, values in prefixes.items()}}


def render_agreement(summary: dict[str, Any] | None) -> list[str]:
    if not summary or not summary["configs"]:
        return []
    lines = ["", f"Greedy text (T = 0) against {summary['reference']}'s on the same prompt and round: "
             "runs whose tokens are all the same / runs, and the median of the tokens they share before "
             "the first difference (bench/greedy_text.py says why this matters for the ratios):", "",
             "| config | identical | first difference (median) |", "|---|---:|---:|"]
    for config, entry in summary["configs"].items():
        lines.append(f"| {config} | {entry['identical']} / {entry['runs']} | {entry['median_prefix']:g} |")
    return lines
