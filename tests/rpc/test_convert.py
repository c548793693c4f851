"""Dataclass ⇄ message conversions: lossless round trips (through bytes), defaults, validation."""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.engine.api import (
    DraftFeatures,
    DraftRequest,
    DraftResult,
    LookaheadBranch,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
    ScoreRequest,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.errors import InvalidRequest
from specdec.generation import (
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    IterationRecord,
)
from specdec.rpc import convert, generation_convert
from specdec.rpc.v1 import common_pb2, drafter_pb2, generation_pb2, verifier_pb2
from specdec.sampling import MIN_TEMPERATURE, SamplingParams, SamplingParamsError
from specdec.verification.base import MethodParams

FAST = settings(max_examples=60, deadline=None)

tokens = st.lists(st.integers(0, 2**31 - 1), max_size=12)
parents = st.lists(st.integers(-1, 30), max_size=12)
non_negative = st.floats(0, 1e6, allow_nan=False)
seeds = st.integers(0, 2**64 - 1)
sampling = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, 100, allow_nan=False)),  # 0: greedy
    top_k=st.integers(0, 2**31 - 1),
    top_p=st.floats(0, 1, exclude_min=True, allow_nan=False),
)
method_params = st.builds(
    MethodParams, a=st.floats(0, 1), k_max=st.integers(0, 64), seed=seeds, position=st.integers(0, 2**40)
)


def via_bytes(msg):
    """Serialise and parse back, so the test covers the wire, not just the message objects."""
    return type(msg).FromString(msg.SerializeToString())


def tensor_or_none(draw_shape):
    return st.one_of(st.none(), draw_shape)


@st.composite
def prob_rows(draw):
    rows, vocab = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    values = draw(st.lists(st.floats(0, 1, width=32), min_size=rows * vocab, max_size=rows * vocab))
    return torch.tensor(values, dtype=torch.float32).reshape(rows, vocab)


@st.composite
def draft_features(draw) -> DraftFeatures:
    """Hidden states of any float32 value (NaN and infinities too: the wire keeps their bits)."""
    positions = draw(st.lists(st.integers(0, 2**40), max_size=4).map(sorted))
    hidden = draw(st.integers(0, 6))
    values = draw(st.lists(st.floats(width=32), min_size=len(positions) * hidden,
                           max_size=len(positions) * hidden))
    rows = torch.tensor(values, dtype=torch.float32).reshape(len(positions), hidden)
    return DraftFeatures(tuple(positions), rows)


def assert_same(a, b) -> None:
    """Dataclass equality that compares tensors bit for bit (nested DraftFeatures too)."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, DraftFeatures) or isinstance(y, DraftFeatures):
            assert x is not None and y is not None, f.name
            assert_same(x, y)
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None, f.name
            assert x.dtype == y.dtype == torch.float32 and x.shape == y.shape, f.name
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), f.name  # bitwise, NaN-safe
        else:
            assert x == y, f.name


@FAST
@given(sampling)
def test_sampling_round_trip(params: SamplingParams) -> None:
    back = generation_convert.sampling_from_proto(via_bytes(generation_convert.sampling_to_proto(params)))
    assert back == params


def test_sampling_keeps_double_precision() -> None:
    """A float32 temperature would make the two sides warp with different numbers."""
    params = SamplingParams(temperature=0.7, top_p=0.9)
    back = generation_convert.sampling_from_proto(via_bytes(generation_convert.sampling_to_proto(params)))
    assert back.temperature == 0.7 and back.top_p == 0.9


def test_sampling_defaults_when_unset_and_validation() -> None:
    assert generation_convert.sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    unset = common_pb2.SamplingParams()
    assert generation_convert.sampling_from_proto(unset, present=False) == SamplingParams()
    assert generation_convert.sampling_from_proto(common_pb2.SamplingParams(temperature=0.0)).greedy
    with pytest.raises(SamplingParamsError, match="top_p"):
        generation_convert.sampling_from_proto(common_pb2.SamplingParams(top_p=1.5))
    with pytest.raises(SamplingParamsError, match="temperature"):
        generation_convert.sampling_from_proto(common_pb2.SamplingParams(temperature=-1.0))


@FAST
@given(method_params)
def test_method_params_round_trip(params: MethodParams) -> None:
    assert convert.method_params_from_proto(via_bytes(convert.method_params_to_proto(params))) == params


def test_method_params_default_a_and_nan() -> None:
    assert convert.method_params_from_proto(common_pb2.MethodParams()).a == 1.0
    with pytest.raises(InvalidRequest, match="params.a"):
        convert.method_params_from_proto(common_pb2.MethodParams(a=math.nan))


@FAST
@given(prob_rows())
def test_tensor_round_trip_bitwise(rows: torch.Tensor) -> None:
    msg = via_bytes(convert.tensor_to_proto(rows))
    assert list(msg.shape) == list(rows.shape) and len(msg.data_f32) == rows.numel() * 4
    back = convert.tensor_from_proto(msg)
    assert back.dtype == torch.float32 and torch.equal(back, rows)
    back[0, 0] = 5.0  # decoded tensors are writable copies, not views of the message bytes
    assert msg.data_f32 == convert.tensor_to_proto(rows).data_f32


def test_tensor_layout_is_little_endian_row_major() -> None:
    t = torch.tensor([[1.0, 2.0], [3.0, 0.5]], dtype=torch.float32)
    assert convert.tensor_to_proto(t).data_f32 == struct.pack("<4f", 1.0, 2.0, 3.0, 0.5)
    non_contiguous = t.t()
    assert convert.tensor_to_proto(non_contiguous).data_f32 == struct.pack("<4f", 1.0, 3.0, 2.0, 0.5)


def test_tensor_only_float32() -> None:
    with pytest.raises(TypeError, match="float32"):
        convert.tensor_to_proto(torch.zeros(2, 3, dtype=torch.float64), "draft_probs")


@pytest.mark.parametrize(
    ("shape", "nbytes", "match"),
    [
        ([2, 3], 20, "draft_probs.data_f32"),
        ([2, 3], 28, "draft_probs.data_f32"),
        ([-1, 3], 0, "draft_probs.shape"),
        ([1] * 9, 4, "draft_probs.shape"),
    ],
)
def test_tensor_decode_validates_sizes(shape, nbytes, match) -> None:
    msg = common_pb2.Tensor(shape=shape, data_f32=b"\0" * nbytes)
    with pytest.raises(InvalidRequest, match=match):
        convert.tensor_from_proto(msg, "draft_probs")


def test_verify_request_with_bad_tensor_names_the_field() -> None:
    msg = verifier_pb2.VerifyRequest(session_id="s", method="token")
    msg.draft_probs.shape.extend([2, 2])
    msg.draft_probs.data_f32 = b"\0" * 12
    with pytest.raises(InvalidRequest, match="draft_probs"):
        convert.verify_request_from_proto(msg)


@FAST
@given(
    session=st.text(max_size=8),
    base_len=st.integers(0, 2**40),
    append=tokens,
    shape=parents,
    params=sampling,
    seed=seeds,
    strategy=st.sampled_from(["sample", "race"]),
    want=st.booleans(),
    leaf=st.booleans(),
    features=st.none() | draft_features(),
)
def test_draft_request_round_trip(
    session, base_len, append, shape, params, seed, strategy, want, leaf, features
) -> None:
    req = DraftRequest(session, base_len, append, shape, params, seed, strategy, want, leaf,
                       cache_partition=session[::-1], features=features)
    assert_same(convert.draft_request_from_proto(via_bytes(convert.draft_request_to_proto(req))), req)


@FAST
@given(
    session=st.text(max_size=8),
    base_len=st.integers(0, 2**40),
    append=tokens,
    k=st.integers(0, 64),
    params=sampling,
    seed=seeds,
    strategy=st.sampled_from(["sample", "race"]),
    want=st.booleans(),
    bonus=st.integers(0, 16),
    rejection=st.integers(0, 16),
)
def test_lookahead_request_round_trip(session, base_len, append, k, params, seed, strategy, want, bonus,
                                      rejection) -> None:
    req = LookaheadRequest(session, base_len, append, k, params, seed, strategy, want, bonus, rejection,
                           cache_partition=session[::-1])
    back = convert.lookahead_request_from_proto(via_bytes(convert.lookahead_request_to_proto(req)))
    assert_same(back, req)


def test_lookahead_request_defaults_when_unset() -> None:
    req = convert.lookahead_request_from_proto(drafter_pb2.LookaheadRequest())
    assert (req.strategy, req.bonus_guesses, req.rejection_guesses) == ("sample", 1, 0)


@st.composite
def lookahead_branches(draw):
    n, vocab = draw(st.integers(0, 4)), draw(st.integers(1, 7))
    toks = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    probs = None
    if draw(st.booleans()):
        values = draw(st.lists(st.floats(0, 1, width=32), min_size=n * vocab, max_size=n * vocab))
        rows = torch.tensor(values, dtype=torch.float32).reshape(n, vocab)
        probs = torch.cat([rows, torch.zeros(1, vocab)])
    draft = DraftResult(toks, list(range(-1, n - 1)), probs)
    return LookaheadBranch(draw(st.booleans()), draw(st.integers(0, 2**31 - 1)), draft)


@FAST
@given(branches=st.lists(lookahead_branches(), max_size=4), fwd=non_negative, reused=st.integers(0, 10**6))
def test_lookahead_result_round_trip(branches, fwd, reused) -> None:
    """The leaf rows (zero by the layout) stay off the wire and come back as zeros."""
    result = LookaheadResult(branches, fwd, reused, cached_tokens=reused // 3)
    msg = convert.lookahead_result_to_proto(result)
    for entry, branch in zip(msg.branches, branches, strict=True):
        if branch.draft.draft_probs is not None:
            vocab = branch.draft.draft_probs.shape[1]
            assert list(entry.draft_rows.shape) == [len(branch.draft.tokens), vocab]
    back = convert.lookahead_result_from_proto(via_bytes(msg))
    assert (back.forward_seconds, back.reused_tokens) == (fwd, reused)
    assert len(back.branches) == len(branches)
    for got, want in zip(back.branches, branches, strict=True):
        assert (got.replaces_last, got.token) == (want.replaces_last, want.token)
        assert_same(got.draft, want.draft)


def test_lookahead_result_with_misshapen_rows_is_invalid() -> None:
    msg = drafter_pb2.LookaheadResult()
    entry = msg.branches.add(tokens=[1, 2])
    entry.draft_rows.CopyFrom(convert.tensor_to_proto(torch.zeros(3, 4), "rows"))
    with pytest.raises(InvalidRequest, match=r"branches\[0\].draft_rows"):
        convert.lookahead_result_from_proto(msg)


def test_draft_request_unset_strategy_is_sample() -> None:
    assert convert.draft_request_from_proto(drafter_pb2.DraftRequest()).strategy == "sample"


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_out_of_range_is_invalid(seed: int) -> None:
    req = DraftRequest("s", 0, [], [], SamplingParams(), seed)
    with pytest.raises(InvalidRequest, match="seed"):
        convert.draft_request_to_proto(req)


@FAST
@given(
    toks=tokens,
    pars=parents,
    rows=tensor_or_none(prob_rows()),
    fwd=non_negative,
    reused=st.integers(0, 10**6),
)
def test_draft_result_round_trip(toks, pars, rows, fwd, reused) -> None:
    result = DraftResult(toks, pars, rows, fwd, reused, cached_tokens=reused // 3)
    assert_same(convert.draft_result_from_proto(via_bytes(convert.draft_result_to_proto(result))), result)


@FAST
@given(
    session=st.text(max_size=8),
    base_len=st.integers(0, 10**6),
    append=tokens,
    tree=tokens,
    pars=parents,
    params=sampling,
)
def test_score_request_round_trip(session, base_len, append, tree, pars, params) -> None:
    req = ScoreRequest(session, base_len, append, tree, pars, params, cache_partition=session[::-1])
    assert_same(convert.score_request_from_proto(via_bytes(convert.score_request_to_proto(req))), req)


@FAST
@given(
    session=st.text(max_size=8),
    base_len=st.integers(0, 10**6),
    append=tokens,
    tree=tokens,
    pars=parents,
    method=st.sampled_from(["token", "block", "ersd", "gsd-tree", "rd"]),
    mparams=method_params,
    params=sampling,
    rows=tensor_or_none(prob_rows()),
    want_features=st.booleans(),
)
def test_verify_request_round_trip(
    session, base_len, append, tree, pars, method, mparams, params, rows, want_features
) -> None:
    req = VerifyRequest(session, base_len, append, tree, pars, method, mparams, params, rows,
                        cache_partition=session[::-1], want_features=want_features)
    assert_same(convert.verify_request_from_proto(via_bytes(convert.verify_request_to_proto(req))), req)


@st.composite
def lean_requests(draw) -> VerifyRequest:
    """A lean VerifyRequest of a sequence: q per node and some of the n + 1 rows."""
    n, vocab = draw(st.integers(0, 5)), draw(st.integers(1, 9))
    probs = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    rows = draw(st.lists(st.integers(0, n), unique=True, max_size=n + 1))
    values = draw(st.lists(st.floats(0, 1, width=32), min_size=len(rows) * vocab, max_size=len(rows) * vocab))
    row_values = torch.tensor(values, dtype=torch.float32).reshape(len(rows), vocab) if rows else None
    return VerifyRequest("s", draw(st.integers(0, 99)), [1], list(range(n)), list(range(-1, n - 1)), "token",
                         MethodParams(seed=3), SamplingParams(), None, probs, rows, row_values)


@FAST
@given(lean_requests())
def test_lean_verify_request_round_trip(req: VerifyRequest) -> None:
    back = convert.verify_request_from_proto(via_bytes(convert.verify_request_to_proto(req)))
    assert_same(back, req)
    assert back.lean == req.lean == bool(req.tree_tokens or req.draft_row_indices)


def _lean_message(**fields) -> verifier_pb2.VerifyRequest:
    """A lean VerifyRequest of two sequence nodes carrying row 1 of V = 3, with `fields` replaced."""
    req = VerifyRequest("s", 0, [1], [4, 5], [-1, 0], "token", MethodParams(), SamplingParams(), None,
                        [0.25, 0.5], [1], torch.ones(1, 3))
    return convert.verify_request_to_proto(dataclasses.replace(req, **fields))


@pytest.mark.parametrize(("fields", "match"), [
    ({"draft_probs": torch.ones(3, 3)}, "either full .* or lean .*, not both"),
    ({"draft_token_probs": [0.25]}, "draft_token_probs holds 1 values for 2 tree nodes"),
    ({"draft_token_probs": [0.25, 0.5, 0.1]}, "draft_token_probs holds 3 values"),
    ({"draft_token_probs": [0.25, math.nan]}, "draft_token_probs must be finite and >= 0"),
    ({"draft_token_probs": [-0.25, 0.5]}, "draft_token_probs must be finite and >= 0"),
    ({"draft_token_probs": [math.inf, 0.5]}, "draft_token_probs must be finite"),
    ({"draft_row_indices": [3]}, r"draft_row_indices \[3\] lie outside the rows \[0, 3\)"),
    ({"draft_row_indices": [-1]}, "draft_row_indices .* outside"),
    ({"draft_row_indices": [1, 1], "draft_row_values": torch.ones(2, 3)}, "draft_row_indices repeat rows"),
    ({"draft_row_values": None}, "draft_row_values are missing for the rows"),
    ({"draft_row_values": torch.ones(2, 3)}, r"draft_row_values must have shape \[1, V\], got \[2, 3\]"),
    ({"draft_row_values": torch.ones(3)}, "draft_row_values must have shape"),
    ({"draft_row_indices": [], "draft_row_values": torch.ones(1, 3)}, "draft_row_values must have shape"),
])
def test_malformed_lean_fields_are_invalid(fields: dict, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        convert.verify_request_from_proto(via_bytes(_lean_message(**fields)))


def test_lean_row_values_with_a_bad_tensor_name_the_field() -> None:
    msg = _lean_message()
    msg.draft_row_values.data_f32 = b"\0" * 5
    with pytest.raises(InvalidRequest, match="draft_row_values.data_f32"):
        convert.verify_request_from_proto(msg)


def test_a_lean_verify_is_far_smaller_on_the_wire() -> None:
    """k = 4 drafts on the default models' vocabulary: full rows [5, V] are ~3 MB; the lean form
    carries 4 doubles, and ~600 KB per row the verifier asks for after a rejection."""
    k, vocab = 4, 151_936
    rows = torch.softmax(torch.randn(k + 1, vocab), dim=-1)
    tokens, parents = [11, 22, 33, 44], [-1, 0, 1, 2]
    base = VerifyRequest("session", 100, [7], tokens, parents, "token", MethodParams(), SamplingParams())
    full = convert.verify_request_to_proto(dataclasses.replace(base, draft_probs=rows)).ByteSize()
    q = [float(rows[i, t] / rows[i].double().sum()) for i, t in enumerate(tokens)]
    lean = convert.verify_request_to_proto(dataclasses.replace(base, draft_token_probs=q)).ByteSize()
    retry = convert.verify_request_to_proto(dataclasses.replace(
        base, draft_token_probs=q, draft_row_indices=[2], draft_row_values=rows[2:3])).ByteSize()
    assert full > (k + 1) * vocab * 4 and lean < 200 and retry < full / 4
    assert full / lean > 10_000


@FAST
@given(
    toks=tokens,
    nodes=tokens,
    flags=st.lists(st.booleans(), max_size=6),
    drafted=st.integers(0, 1000),
    committed=st.integers(0, 10**6),
    fwd=non_negative,
    ver=non_negative,
    reused=st.integers(0, 10**6),
    calls=st.integers(1, 64),
    rows=st.none() | st.integers(0, 10**6),
    pending=st.integers(0, 10**6),
    score_reused=st.booleans(),
    fallbacks=st.integers(0, 64),
    needed=st.lists(st.integers(0, 64), max_size=4),
    features=st.none() | draft_features(),
)
def test_verify_outcome_round_trip(toks, nodes, flags, drafted, committed, fwd, ver, reused, calls, rows,
                                   pending, score_reused, fallbacks, needed, features) -> None:
    outcome = VerifyOutcome(toks, nodes, flags, drafted, committed, fwd, ver, reused, pass_calls=calls,
                            pass_rows=rows, pending_tokens=pending, score_reused=score_reused,
                            text_fallbacks=fallbacks, draft_rows_needed=needed, cached_tokens=reused // 2,
                            features=features)
    assert_same(
        convert.verify_outcome_from_proto(via_bytes(convert.verify_outcome_to_proto(outcome))), outcome
    )


def test_verify_outcome_pass_shape_defaults_when_unset() -> None:
    """An outcome without a pass of its own (or from a verifier that predates the fields): one call,
    rows unknown; zero rows stays distinct from unknown. The old `extra` map (field 9) is skipped."""
    old_wire = bytes([0x4A, 0x00])  # field 9, length-delimited, empty: what an old verifier may send
    back = convert.verify_outcome_from_proto(verifier_pb2.VerifyOutcome.FromString(old_wire))
    assert (back.pass_calls, back.pass_rows, back.score_reused, back.features) == (1, None, False, None)
    zero = convert.verify_outcome_to_proto(VerifyOutcome([], [], [], 0, 0, pass_rows=0))
    assert convert.verify_outcome_from_proto(via_bytes(zero)).pass_rows == 0


def test_draft_features_round_trip_bitwise_and_shape_checked() -> None:
    """The channel keeps every bit of the hidden states, and a message whose rows do not match its
    positions is refused with the field named."""
    hidden = torch.tensor([[1.5, float("nan")], [-0.0, float("inf")]], dtype=torch.float32)
    features = DraftFeatures((7, 8), hidden)
    back = convert.draft_features_from_proto(via_bytes(convert.draft_features_to_proto(features)))
    assert back.positions == (7, 8)
    assert torch.equal(back.hidden.view(torch.int32), hidden.view(torch.int32))
    bad = convert.draft_features_to_proto(features)
    del bad.positions[-1]
    with pytest.raises(InvalidRequest, match="features.hidden"):
        convert.draft_features_from_proto(bad)
    with pytest.raises(TypeError, match="features.hidden"):
        convert.draft_features_to_proto(DraftFeatures((1,), torch.zeros((1, 2), dtype=torch.float64)))


def test_model_info_round_trip() -> None:
    info = ModelInfo("tiny", 6, "abc123", 128, (5,), "cuda:1", "bfloat16")
    assert convert.model_info_from_proto(via_bytes(convert.model_info_to_proto(info))) == info


optional_ids = st.one_of(st.none(), tokens)
generation_requests = st.builds(
    GenerationRequest,
    prompt=st.one_of(st.none(), st.text(max_size=10)),
    prompt_ids=optional_ids,
    max_new_tokens=st.integers(0, 4096),
    sampling=sampling,
    stop=st.lists(st.text(max_size=4), max_size=3),
    stop_token_ids=optional_ids,
    seed=st.one_of(st.none(), seeds),
    method=st.one_of(st.none(), st.sampled_from(["token", "block", "ersd", "gsd-tree", "rd",
                                                 "autoregressive"])),
    k=st.one_of(st.none(), st.integers(0, 64)),
    a=st.one_of(st.none(), st.floats(0, 1)),
    request_id=st.one_of(st.none(), st.text(max_size=8)),
    tree_budget=st.one_of(st.none(), st.integers(0, 256)),
    pipeline=st.one_of(st.none(), st.booleans()),
    pipeline_max_k=st.one_of(st.none(), st.integers(0, 64)),
    pipeline_bonus_guesses=st.one_of(st.none(), st.integers(0, 16)),
    pipeline_rejection_guesses=st.one_of(st.none(), st.integers(0, 16)),
    cache_salt=st.one_of(st.none(), st.text(max_size=8)),
)


@FAST
@given(generation_requests)
def test_generation_request_round_trip(req: GenerationRequest) -> None:
    wire = via_bytes(generation_convert.generation_request_to_proto(req))
    assert generation_convert.generation_request_from_proto(wire) == req


def test_generation_request_none_differs_from_empty() -> None:
    """stop_token_ids=None means 'the target's EOS ids'; [] means 'no stop tokens'."""
    for value in (None, []):
        req = GenerationRequest(prompt_ids=[1, 2], stop_token_ids=value, seed=0)
        wire = via_bytes(generation_convert.generation_request_to_proto(req))
        back = generation_convert.generation_request_from_proto(wire)
        assert back.stop_token_ids == value and back.prompt is None and back.seed == 0


def test_generation_request_defaults_when_unset() -> None:
    unset = generation_pb2.GenerationRequest()
    assert generation_convert.generation_request_from_proto(unset) == GenerationRequest()


def test_unset_knobs_stay_unset_on_the_wire() -> None:
    """A request naming no method, k, a or pipeline sends none of them (the orchestrator's defaults
    apply), and the server reads None for each, not a default of its own."""
    msg = generation_convert.generation_request_to_proto(GenerationRequest(prompt="p"))
    assert not any(msg.HasField(name) for name in ("method", "k", "a", "pipeline"))
    back = generation_convert.generation_request_from_proto(via_bytes(msg))
    assert (back.method, back.k, back.a, back.pipeline) == (None, None, None, None)
    named = generation_convert.generation_request_to_proto(GenerationRequest(prompt="p", method="ersd"))
    assert named.HasField("method") and named.method == "ersd"


intervals = st.lists(st.tuples(non_negative, non_negative), max_size=3)
records = st.builds(
    IterationRecord,
    request_id=st.text(max_size=6),
    index=st.integers(0, 1000),
    position=st.integers(0, 10**6),
    method=st.sampled_from(["token", "rd", "autoregressive"]),
    a=st.one_of(st.none(), st.floats(0, 1)),
    k=st.integers(0, 64),
    heads=st.one_of(st.none(), st.integers(0, 64)),
    drafted=st.booleans(),
    num_drafted=st.integers(0, 64),
    accepted=st.integers(0, 64),
    emitted=tokens,
    fallback=st.booleans(),
    start=non_negative,
    end=non_negative,
    draft_intervals=intervals,
    verify_intervals=intervals,
    overlap_seconds=non_negative,
)
stats = st.builds(
    GenerationStats,
    iterations=st.integers(0, 10**6),
    drafted_iterations=st.integers(0, 10**6),
    drafted_tokens=st.integers(0, 10**9),
    accepted_tokens=st.integers(0, 10**9),
    new_tokens=st.integers(0, 10**9),
    seconds=non_negative,
    draft_seconds=non_negative,
    verify_seconds=non_negative,
    overlap_seconds=non_negative,
    accepted_per_position=st.lists(st.integers(0, 10**6), max_size=8),
    drafted_per_position=st.lists(st.integers(0, 10**6), max_size=8),
    fallback_iterations=st.integers(0, 10**6),
    pre_drafts_used=st.integers(0, 10**6),
    pre_drafts_dropped=st.integers(0, 10**6),
    pre_draft_bonus_hits=st.lists(st.integers(0, 10**6), max_size=4),
    pre_draft_rejection_hits=st.lists(st.integers(0, 10**6), max_size=4),
    cached_tokens=st.integers(0, 10**6),
)
results = st.builds(
    GenerationResult,
    request_id=st.text(max_size=8),
    token_ids=tokens,
    text=st.text(max_size=20),
    finish_reason=st.sampled_from(["length", "eos", "stop"]),
    seed=seeds,
    method=st.sampled_from(["token", "ersd"]),
    stats=stats,
    iterations=st.lists(records, max_size=3),
    started_at=non_negative,
)


@FAST
@given(results)
def test_generation_result_round_trip(result: GenerationResult) -> None:
    msg = via_bytes(generation_convert.generation_result_to_proto(result))
    assert generation_convert.generation_result_from_proto(msg) == result
    assert msg.stats.tokens_per_second == pytest.approx(result.stats.tokens_per_second)
    assert msg.stats.acceptance_rate == pytest.approx(result.stats.acceptance_rate)


@FAST
@given(toks=tokens, text=st.text(max_size=10), result=st.one_of(st.none(), results))
def test_generation_chunk_round_trip(toks, text, result) -> None:
    chunk = GenerationChunk(toks, text, result)
    wire = via_bytes(generation_convert.generation_chunk_to_proto(chunk))
    assert generation_convert.generation_chunk_from_proto(wire) == chunk


PAIRS = [
    (SamplingParams, common_pb2.SamplingParams),
    (MethodParams, common_pb2.MethodParams),
    (ModelInfo, common_pb2.ModelInfo),
    (DraftRequest, drafter_pb2.DraftRequest),
    (DraftResult, drafter_pb2.DraftResult),
    (LookaheadRequest, drafter_pb2.LookaheadRequest),
    (ScoreRequest, verifier_pb2.ScoreRequest),
    (VerifyRequest, verifier_pb2.VerifyRequest),
    (VerifyOutcome, verifier_pb2.VerifyOutcome),
    (GenerationRequest, generation_pb2.GenerationRequest),
    (GenerationStats, generation_pb2.GenerationStats),
    (GenerationResult, generation_pb2.GenerationResult),
    (GenerationChunk, generation_pb2.GenerationChunk),
    (IterationRecord, generation_pb2.IterationRecord),
]


@pytest.mark.parametrize(("cls", "message"), PAIRS, ids=[c.__name__ for c, _ in PAIRS])
def test_every_dataclass_field_is_on_the_wire(cls, message) -> None:
    """A field added to a dataclass must be added to its message (and to specdec/rpc/convert.py)."""
    missing = {f.name for f in dataclasses.fields(cls)} - set(message.DESCRIPTOR.fields_by_name)
    assert not missing, (
        f"{cls.__name__} fields missing from {message.DESCRIPTOR.full_name}: {sorted(missing)}"
    )
