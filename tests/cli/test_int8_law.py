"""The output law at the default precision (int8 on a CPU), through `specdec generate`.

Every method's samples are tested against the exact law of the *same int8 model* run one token
per pass, computed by enumeration; token verification's samples are also tested against the
autoregressive samples (two-sample). Before the per-row int8 path these differed (the issue that
brought it measured p = 5e-4 token vs autoregressive at n = 20,000): a verify pass saw other rows
than a one-token pass. The negative control below computes, exactly, what the per-tensor path's
verify passes gave the verifier for this prompt: a law measurably off the one it must sample.

Sample counts: SPECDEC_LAW_SAMPLES per method (default 600) and twice that for the two-sample
pair; SPECDEC_LAW_METHODS=token,autoregressive limits the run to those, for a two-sample test
at n = 20,000 per arm: SPECDEC_LAW_SAMPLES=10000 (about 14 minutes on two cores).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scipy.stats import chi2_contingency

from specdec.runtime.kv import TreeKVCache
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from specdec.sampling import SamplingParams, warp_logits
from tests.orchestrator.helpers import chi_square_p

VOCAB = 6
PROMPT = [0, 3]
LENGTH = 3
SAMPLES = int(os.environ.get("SPECDEC_LAW_SAMPLES", "600"))
P_THRESHOLD = 1e-3
METHODS = {
    "autoregressive": [],
    "token": ["--k", "2"],
    "block": ["--k", "3"],
    "ersd": ["--k", "2"],
    "rd": ["--k", "2", "--a", "0.5"],
    "gsd-tree": ["--k", "4"],
    # Model-free drafts (docs/algorithms.md §15) through the same CLI: "method@source".
    "token@lookup": ["--k", "2", "--draft-source", "lookup"],
    "block@suffix": ["--k", "3", "--draft-source", "suffix"],
    "gsd-tree@suffix": ["--k", "4", "--draft-source", "suffix"],
}
TWO_SAMPLE = ("token", "autoregressive")
CHOSEN = [m for m in os.environ.get("SPECDEC_LAW_METHODS", ",".join(METHODS)).split(",") if m in METHODS]


def one_token_law(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(x1 x2 x3 | prompt), every row from a cache fed one token per pass."""
    rows: dict[tuple[int, ...], torch.Tensor] = {}

    def row(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in rows:
            kv = TreeKVCache(model)
            for token in prefix:
                logits = kv.extend_chain([token])[-1]
                kv.settle([0])
            rows[prefix] = warp_logits(logits.double()[None], SamplingParams(1.0))[0]
        return rows[prefix]

    law = {}
    for path in itertools.product(range(VOCAB), repeat=LENGTH):
        p = 1.0
        for i, token in enumerate(path):
            p *= float(row(tuple(prompt) + path[:i])[token])
        law[path] = p
    return law


def verify_pass_law(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The same product, each path's three rows taken from one pass over prompt[-1:] + path[:2]
    after a prefill: what a k = 2 verify pass that drafted path[:2] hands the verifier."""
    law = {}
    for path in itertools.product(range(VOCAB), repeat=LENGTH):
        kv = TreeKVCache(model)
        kv.prefill(prompt[:-1])
        logits = kv.extend_chain([prompt[-1], *path[:2]], rows_from=0).double()
        rows = warp_logits(logits, SamplingParams(1.0))
        law[path] = float(rows[0, path[0]] * rows[1, path[1]] * rows[2, path[2]])
    return law


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8-law")
    return (save_tiny_model(root / "draft", vocab_size=VOCAB, seed=222, num_layers=1),
            save_tiny_model(root / "target", vocab_size=VOCAB, seed=111, num_layers=1))


@pytest.fixture(scope="module")
def samples(pair) -> dict[str, list[tuple[int, ...]]]:
    """Every method's samples from `specdec generate`, all CLI processes at once: each spends most
    of a sample waiting (its passes' gather windows, its threads' hand-offs), so together they keep
    two cores busy where two at a time left them mostly idle."""
    draft, target = pair
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    commands = {}
    for index, (method, knobs) in enumerate(METHODS.items()):
        if method not in CHOSEN:
            continue
        n = SAMPLES * (2 if method in TWO_SAMPLE else 1)
        commands[method] = [
            sys.executable, "-m", "specdec.cli", "generate", "--draft", str(draft), "--target", str(target),
            "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(LENGTH), "--ignore-eos",
            "--json", "--num-samples", str(n), "--seed", str(10**6 * (index + 1)),
            # --dtype: the default (auto: int8 here)
            "--threads", "1", "--method", method.split("@")[0], *knobs]

    def run(command: list[str]) -> tuple[int, str, str]:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        try:
            out, err = process.communicate(timeout=900)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        return process.returncode, out, err

    with ThreadPoolExecutor(max_workers=max(1, len(commands))) as pool:
        finished = dict(zip(commands, pool.map(run, commands.values()), strict=True))
    results: dict[str, list[tuple[int, ...]]] = {}
    for method, (code, out, err) in finished.items():
        assert code == 0, (method, err[-2000:])
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert all(line["method"] == method.split("@")[0] for line in lines)
        if "@" in method:  # the model-free source drafted
            drafted = sum(line["stats"]["sources"].get(method.split("@")[1], {}).get("drafted_tokens", 0)
                          for line in lines)
            assert drafted > len(lines) // 4, (method, drafted)
        results[method] = [tuple(line["token_ids"]) for line in lines]
    return results


@pytest.fixture(scope="module")
def exact(pair):
    model = load_model(pair[1], dtype="auto", threads=1)  # the CLI's default precision, as it loads it
    assert model.info.dtype == "int8"
    with torch.no_grad():
        return one_token_law(model.model, PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_samples_the_one_token_law_at_int8(samples, exact, method):
    if method not in CHOSEN:
        pytest.skip("not in SPECDEC_LAW_METHODS")
    drawn = samples[method]
    assert len(drawn) == SAMPLES * (2 if method in TWO_SAMPLE else 1)
    p = chi_square_p(drawn, exact)
    print(f"{method}: chi-square against the one-token law, n = {len(drawn)}: p = {p:.3g}")
    assert p > P_THRESHOLD


@pytest.mark.slow
def test_token_verification_and_autoregressive_samples_share_a_law(samples):
    if not set(TWO_SAMPLE) <= set(CHOSEN):
        pytest.skip("not in SPECDEC_LAW_METHODS")
    a, b = (samples[m] for m in TWO_SAMPLE)
    cells = sorted(set(a) | set(b))
    table = [[a.count(c) for c in cells], [b.count(c) for c in cells]]
    # pool the sparse cells (expected < 5) into one, as the one-sample test does
    dense = [i for i, c in enumerate(cells) if table[0][i] + table[1][i] >= 10]
    rest = [sum(row) - sum(row[i] for i in dense) for row in table]
    extra = sum(rest) > 0  # at large n no cell is sparse: an all-zero column would break the test
    pooled = [[row[i] for i in dense] + ([r] if extra else []) for row, r in zip(table, rest, strict=True)]
    p = chi2_contingency(pooled).pvalue
    print(f"two-sample chi-square, n = {len(a)} and {len(b)}: p = {p:.3g}")
    assert p > P_THRESHOLD


def test_verify_passes_hand_the_verifier_the_one_token_law(pair):
    """Exactly (no sampling): at int8 the rows of a k = 2 verify pass give the one-token law."""
    model = load_model(pair[1], dtype="int8", threads=1).model
    with torch.no_grad():
        reference, verified = one_token_law(model, PROMPT), verify_pass_law(model, PROMPT)
    assert verified == reference


def test_negative_control_per_tensor_verify_passes_move_the_law(pair):
    """The former per-tensor int8: the law its verify passes gave is off the one-token law."""
    model = load_model(pair[1], dtype="float32", threads=1).model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    with torch.no_grad():
        reference, verified = one_token_law(model, PROMPT), verify_pass_law(model, PROMPT)
    tv = 0.5 * sum(abs(reference[k] - verified[k]) for k in reference)
    assert tv > 1e-4, tv
