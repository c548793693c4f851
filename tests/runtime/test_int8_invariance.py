"""At int8 (the CPU default) a row's logits do not depend on the other rows of its pass.

A context's rows are computed one token per pass (the reference), then inside a k + 1 verify
pass, inside a tree pass beside other branches, and inside batched passes beside sessions of
other lengths: every row must be bitwise the reference (docs/algorithms.md §14). The same checks
run on torch.ao's per-tensor dynamic quantisation (the former default) and on per-row linears
with float32 attention, and must fail there: they are what the invariant path fixes.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher, _Job
from specdec.runtime.fixed_attention import ATTENTION_ENV, FIXED_ORDER, FLOAT64
from specdec.runtime.int8 import (
    FBGEMM,
    INT_MM,
    RowwiseInt8Linear,
    fbgemm_available,
    quantize_linears,
    use_invariant_attention,
)
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.loading import quantize_int8
from specdec.runtime.tiny import build_tiny_model

VOCAB = 48
CONTEXT = 40
SAMPLE_ROWS = 24  # positions checked per pass shape


def tiny(seed: int = 3):
    torch.set_num_threads(2)  # the blocking of a two-thread pass differs from a one-thread one
    return build_tiny_model(vocab_size=VOCAB, seed=seed, hidden_size=64, num_layers=3,
                            max_position_embeddings=256, logit_scale=1.0)


def per_tensor(model):
    """The former default: torch.ao's dynamic quantisation, one activation scale per tensor."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def rowwise_float32_attention(model):
    """Per-row int8 linears, but transformers' float32 sdpa attention."""
    return quantize_linears(model, kv_dtype=torch.float32)


def reference_rows(model, context: list[int]) -> list[torch.Tensor]:
    """Row t: the logits after context[:t + 1], every token forwarded in a pass of its own."""
    kv, rows = TreeKVCache(model), []
    for token in context:
        rows.append(kv.extend_chain([token])[-1])
        kv.settle([0])
    return rows


def verify_rows(model, context: list[int], start: int) -> list[torch.Tensor]:
    """Rows start.. from one pass over context[start:] after a prefill (a k + 1 verify pass)."""
    kv = TreeKVCache(model)
    kv.prefill(context[:start])
    return list(kv.extend_chain(context[start:], rows_from=0))


def tree_rows(model, context: list[int], start: int, rng: random.Random) -> list[torch.Tensor]:
    """The chain context[start:] inside a tree: every chain node has a random side branch."""
    kv = TreeKVCache(model)
    kv.prefill(context[:start])
    tokens, parents, chain = [], [], []
    for token in context[start:]:
        parent = chain[-1] if chain else -1
        if rng.random() < 0.7:  # a sibling branch of one or two nodes before the chain node
            tokens.append(rng.randrange(VOCAB))
            parents.append(parent)
            if rng.random() < 0.5:
                tokens.append(rng.randrange(VOCAB))
                parents.append(len(tokens) - 2)
        tokens.append(token)
        parents.append(parent)
        chain.append(len(tokens) - 1)
    logits = kv.extend(tokens, parents)
    return [logits[i] for i in chain]


def batched_rows(model, context: list[int], start: int, rng: random.Random) -> list[torch.Tensor]:
    """The verify pass of `context` batched with three other sessions of other lengths."""
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    jobs = []
    for index in range(4):
        kv = TreeKVCache(model, runner=batcher)
        if index == 1:
            ours, tokens = kv, context
            kv.prefill(context[:start])
            new = context[start:]
        else:
            tokens = [rng.randrange(VOCAB) for _ in range(rng.randrange(5, 70))]
            kv.prefill(tokens[:-3])
            new = tokens[-3:]
        jobs.append(_Job(kv=kv, plan=kv.plan(new, [-1] + list(range(len(new) - 1)), 0)))
    batcher._execute(jobs)
    assert all(job.error is None for job in jobs)
    assert ours is jobs[1].kv
    return list(jobs[1].logits)


def differences(model, seed: int = 0) -> dict[str, tuple[int, float]]:
    """Per pass shape: (rows not bitwise equal to the reference, largest total variation)."""
    rng = random.Random(seed)
    out: dict[str, tuple[int, float]] = {}
    for _ in range(2):
        context = [rng.randrange(VOCAB) for _ in range(CONTEXT)]
        reference = reference_rows(model, context)
        start = CONTEXT - SAMPLE_ROWS
        shapes = {
            "verify pass of 9": verify_rows(model, context[:start + 9], start),
            "verify pass": verify_rows(model, context, start),
            "tree pass": tree_rows(model, context, start, rng),
            "batched pass": batched_rows(model, context, start, rng),
        }
        for name, rows in shapes.items():
            unequal, worst = out.get(name, (0, 0.0))
            for offset, row in enumerate(rows):
                expected = reference[start + offset]
                unequal += not torch.equal(row, expected)
                p, q = (torch.softmax(r.double(), -1) for r in (row, expected))
                tv = 0.5 * (p - q).abs().sum()
                worst = max(worst, float(tv))
            out[name] = (unequal, worst)
    return out


@pytest.mark.parametrize(("attention", "grouped_one_row_from"),
                         [(FIXED_ORDER, None), (FLOAT64, None), (FLOAT64, 1)])
def test_int8_rows_are_the_same_in_every_pass_shape(attention, grouped_one_row_from, monkeypatch):
    """Both invariant attentions: the fixed-order kernel (the default), and float64, whose one-row
    passes run the sdpa kernel below GROUPED_ONE_ROW_FROM_KEYS keys and the grouped float64
    products from there on (as its multi-row passes do): rows are bitwise equal every way."""
    from specdec.runtime import int8

    monkeypatch.setenv(ATTENTION_ENV, attention)
    if grouped_one_row_from is not None:
        monkeypatch.setattr(int8, "GROUPED_ONE_ROW_FROM_KEYS", grouped_one_row_from)
    with torch.no_grad():
        model = quantize_int8(tiny())
        assert model.config._attn_implementation == (
            int8.FIXED_ORDER_ATTENTION if attention == FIXED_ORDER else int8.INVARIANT_ATTENTION)
        found = differences(model)
    assert all(unequal == 0 for unequal, _ in found.values()), found


@pytest.mark.parametrize("variant", [per_tensor, rowwise_float32_attention])
def test_negative_control_fails_the_same_check(variant):
    """Per-tensor scales (the old default), or float32 attention feeding per-row rounding, move rows."""
    with torch.no_grad():
        found = differences(variant(tiny()))
    assert sum(unequal for unequal, _ in found.values()) > 0, found
    if variant is per_tensor:  # not a rounding curiosity: the law moves
        assert max(tv for _, tv in found.values()) > 1e-4, found


# ------------------------------------------------------------------------------------------------
# the linear layer itself


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_alone_equals_the_row_inside_any_pass(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias)
    layer = RowwiseInt8Linear.from_linear(linear)
    x = torch.randn(33, 96) * torch.rand(33, 1) * 5
    full = layer(x)
    for i in range(33):
        assert torch.equal(layer(x[i:i + 1]), full[i:i + 1])
    assert torch.equal(layer(x[7:19]), full[7:19])
    assert (full - linear(x)).abs().max() < 0.05 * linear(x).abs().max()  # and it is still that Linear


@pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no fbgemm")
def test_fbgemm_and_int_mm_kernels_compute_the_same_numbers():
    """The fast kernel and the fallback: int32 sums are exact, the epilogue is the same product."""
    torch.manual_seed(1)
    for inputs, outputs, rows in ((64, 24, 1), (200, 130, 9), (1536, 256, 5)):
        linear = torch.nn.Linear(inputs, outputs)
        fast = RowwiseInt8Linear.from_linear(linear, FBGEMM)
        fallback = RowwiseInt8Linear.from_linear(linear, INT_MM)
        x = torch.randn(rows, inputs) * 3
        assert torch.equal(fast(x), fallback(x))
        assert torch.equal(fast.weight_scale, fallback.weight_scale)


def test_zero_rows_and_output_dtype():
    linear = torch.nn.Linear(16, 8)
    layer = RowwiseInt8Linear.from_linear(linear, output_dtype=torch.float64)
    out = layer(torch.zeros(2, 3, 16))
    assert out.shape == (2, 3, 8) and out.dtype == torch.float64
    assert torch.equal(out, linear.bias.detach().double().expand(2, 3, 8))


# ------------------------------------------------------------------------------------------------
# the device's fast precision (bfloat16 on CUDA): measured, not assumed


def test_pass_shapes_at_the_test_devices_fast_precision():
    """SPECDEC_TEST_DEVICE=cuda runs this at bfloat16 on a GPU (the device check); here float32.

    Neither is built to be batch-invariant: the test prints how far rows move between pass
    shapes and bounds it loosely (a wrong mask or layout moves a row by far more).
    """
    import os

    device = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("SPECDEC_TEST_DEVICE names CUDA, which this machine lacks")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.no_grad():
        found = differences(tiny().to(device=device, dtype=dtype))
    print(f"pass-shape differences on {device} at {dtype}: {found}")
    assert max(tv for _, tv in found.values()) < 1e-2, found


def test_projections_of_one_input_share_a_product_and_compute_what_separate_layers_do():
    from specdec.runtime.int8 import SHARED_INPUTS

    model = tiny()
    separate = tiny()
    quantize_linears(model)
    kv_dtype = model.model.layers[0].self_attn.k_proj.output_dtype  # what the attention reads
    for parent in separate.modules():  # the same layers, each with a product of its own
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                dtype = kv_dtype if name in ("k_proj", "v_proj") else torch.float32
                setattr(parent, name, RowwiseInt8Linear.from_linear(child, output_dtype=dtype))
    use_invariant_attention(model)
    use_invariant_attention(separate)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.product is attention.k_proj.product is attention.v_proj.product
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.product is mlp.up_proj.product is not mlp.down_proj.product
    assert SHARED_INPUTS
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, separate(ids).logits)


def test_a_shared_product_is_recomputed_for_a_changed_or_new_input():
    linears = [torch.nn.Linear(16, 4), torch.nn.Linear(16, 6)]
    first, second = RowwiseInt8Linear.sharing_input(linears, [torch.float32, torch.float32])
    x = torch.randn(3, 16)
    expected = [RowwiseInt8Linear.from_linear(linear)(x) for linear in linears]
    assert torch.equal(first(x), expected[0]) and torch.equal(second(x), expected[1])
    first(x)
    x.mul_(2)  # changed in place between siblings: the product must not be reused
    assert torch.equal(second(x), RowwiseInt8Linear.from_linear(linears[1])(x))
    with torch.inference_mode():
        y = torch.randn(2, 16)
        assert torch.equal(first(y), RowwiseInt8Linear.from_linear(linears[0])(y))
        assert torch.equal(second(y), RowwiseInt8Linear.from_linear(linears[1])(y))


def test_a_member_asking_twice_for_one_input_is_not_scaled_twice():
    """Members scale their own columns of the shared product in place: a repeat call recomputes."""
    linears = [torch.nn.Linear(16, 4, bias=False), torch.nn.Linear(16, 6, bias=False)]
    first, second = RowwiseInt8Linear.sharing_input(linears, [torch.float32, torch.float32])
    alone = [RowwiseInt8Linear.from_linear(linear) for linear in linears]
    with torch.inference_mode():
        x = torch.randn(5, 16)
        assert torch.equal(first(x), alone[0](x))
        assert torch.equal(first(x), alone[0](x))  # the same member again, before its sibling
        assert torch.equal(second(x), alone[1](x))
        assert torch.equal(second(x), alone[1](x))
