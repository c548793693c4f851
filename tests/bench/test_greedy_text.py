"""bench.greedy_text: which configurations of a run wrote the reference's greedy text."""

from __future__ import annotations

from bench.greedy_text import agreed_prefix, agreement, render_agreement


def test_agreed_prefix_counts_leading_tokens_only() -> None:
    assert agreed_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert agreed_prefix([1, 2, 4, 4], [1, 2, 3, 4]) == 2
    assert agreed_prefix([9], [1]) == 0
    assert agreed_prefix([1, 2], [1, 2, 3]) == 2  # a shorter text agrees as far as it goes


def _run(config: str, item: str, tokens: list[int], *, rnd: int = 0, temperature: float = 0.0) -> dict:
    return {"config": config, "item": item, "round": rnd, "temperature": temperature, "token_ids": tokens}


def test_agreement_against_target_only_per_prompt_and_round() -> None:
    details = [
        _run("target-only", "a", [1, 2, 3]), _run("target-only", "b", [4, 5, 6]),
        _run("target-only", "a", [1, 2, 7], rnd=1),
        _run("specdec", "a", [1, 2, 3]), _run("specdec", "b", [4, 5, 6]),
        _run("specdec", "a", [1, 2, 7], rnd=1),
        _run("hf", "a", [1, 9, 9]), _run("hf", "b", [4, 5, 6]),
        _run("hf-lookup", "a", [1, 2, 3], rnd=1),  # round 1's reference differs at its third token
        _run("hf", "a", [8, 8, 8], temperature=1.0),  # sampled: never compared
    ]
    summary = agreement(details, ["hf", "hf-lookup", "specdec", "target-only"])
    assert summary["reference"] == "target-only"
    assert summary["configs"] == {
        "specdec": {"runs": 3, "identical": 3, "median_prefix": 3},
        "hf": {"runs": 2, "identical": 1, "median_prefix": 2.0},
        "hf-lookup": {"runs": 1, "identical": 0, "median_prefix": 2},
    }
    lines = render_agreement(summary)
    assert "| specdec | 3 / 3 | 3 |" in lines and "| hf | 1 / 2 | 2 |" in lines


def test_specdec_is_the_reference_without_target_only_and_none_without_either() -> None:
    details = [_run("specdec", "a", [1, 2]), _run("hf", "a", [1, 3])]
    assert agreement(details, ["hf", "specdec"])["reference"] == "specdec"
    assert agreement(details, ["hf", "hf-lookup"]) is None
    assert render_agreement(None) == []
