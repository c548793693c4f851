"""The ERSD winner of one target row at T = 1: every token scored (before) against race_winner_at
(after), 1 thread, median ms over 200 positions; rows of the default target's real logits at T = 1
(greedy-decoded prompts' next-token rows) and synthetic ones (softmax of N(0, s²) logits).

    PYTHONPATH=. python bench/results/xeon-2026-12-03-b/race_winner.py
"""

import statistics
import time

import numpy as np
import torch

from specdec.races import race, race_scores, race_winner_at


def before(seed: int, position: int, row: torch.Tensor) -> int:
    scores = race_scores(race(seed, position, row.shape[-1]), row)
    return int(torch.argmin(scores).item())


def median_ms(fn, rows: list[torch.Tensor]) -> float:
    times = []
    for position, row in enumerate(rows):
        began = time.perf_counter()
        fn(7, position, row)
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def model_rows(count: int) -> list[torch.Tensor]:
    """Next-token distributions of the default target at T = 1 along a greedy continuation."""
    from specdec.models import resolve_model
    from specdec.runtime.loading import load_model

    loaded = load_model(resolve_model("qwen2.5-coder-1.5b"), dtype="int8", threads=1)
    ids = loaded.tokenizer("Write a short story about a lighthouse keeper who", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = loaded.model.generate(ids, max_new_tokens=count, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    return [torch.softmax(logits[0].float(), -1) for logits in out.logits]


def main() -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    cases = {}
    for scale in (1.0, 3.0, 6.0):
        logits = [torch.from_numpy(rng.standard_normal(151_936) * scale).float() for _ in range(200)]
        cases[f"synthetic s={scale}"] = [torch.softmax(row, -1) for row in logits]
    cases["default target, T = 1"] = model_rows(48) * 4
    for name, rows in cases.items():
        assert all(before(7, i, r) == race_winner_at(7, i, r) for i, r in enumerate(rows))
        old, new = median_ms(before, rows), median_ms(race_winner_at, rows)
        print(f"{name}: every token scored {old:.2f} ms, race_winner_at {new:.2f} ms ({old / new:.1f}x)")


if __name__ == "__main__":
    main()
