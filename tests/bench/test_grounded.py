"""bench.bench_grounded and its workloads (bench.grounded_prompts): the prompt sets are well formed
and grounded (the mechanical answers' words are in the input), the YAML/JSON pairs agree, the run
order (phases, agent families as units), the summary and tables from a hand-made run, the
options' defaults, and one in-process run of the HF rows on the tiny pair (the server rows need
the default pair: the lead runs them)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from bench import bench_grounded as bg
from bench import grounded_prompts as gp
from specdec.generation import CHAT_ROLES

WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def input_text(item: gp.Item) -> str:
    return "\n".join(m.content for m in item.messages)


def offline_items() -> list[gp.Item]:
    """Every prompt written here (open is bench_mixed's, read from the prompt sets)."""
    items = gp.workload_items(["grounded", "multiturn", "agent"], 3)
    return [item for its in items.values() for item in its]


# ----------------------------------------------------------------------------------------------
# the workloads
# ----------------------------------------------------------------------------------------------
def test_prompts_are_well_formed_chats_of_a_few_hundred_tokens() -> None:
    items = offline_items()
    assert len({item.id for item in items}) == len(items)
    for item in items:
        assert item.chat and item.text is None, item.id
        assert all(m.role in CHAT_ROLES and m.content.strip() for m in item.messages), item.id
        assert item.messages[-1].role == "user", item.id
        assert 800 <= len(input_text(item)) <= 6000, (item.id, len(input_text(item)))  # ~250–1500 tokens
        assert item.grounding and item.grounding in input_text(item), item.id


def test_every_grounded_kind_has_three_prompts_and_per_kind_takes_the_first() -> None:
    every = gp.grounded_items(3)
    assert [item.kind for item in every] == [kind for kind in gp.GROUNDED_KINDS for _ in range(3)]
    two = gp.grounded_items(2)
    assert [item.id for item in two] == [item.id for item in every if int(item.id.rsplit("/", 1)[1]) < 2]
    assert len(gp.multiturn_items(3)) == 3 and len(gp.agent_families(3)) == 3
    assert len(gp.multiturn_items(9)) == 3  # at most what is written


@pytest.mark.parametrize("kind", ["yaml2json", "json2yaml", "rename", "extract"])
def test_mechanical_answers_copy_their_input(kind) -> None:
    """Most words of the expected answer appear in the prompt (all of them, but for the new name of
    a rename and JSON's/YAML's own punctuation words): the answer is grounded in the input."""
    items = [item for item in gp.grounded_items(3) if item.kind == kind]
    for item in items:
        assert item.expected, item.id
        given = set(words(input_text(item)))
        expected = words(item.expected)
        share = sum(w in given for w in expected) / len(expected)
        assert share >= 0.9, (item.id, share)
        assert len(item.expected) >= 300, item.id  # a long enough answer to copy


def test_reformat_pairs_agree_with_a_yaml_parser() -> None:
    yaml = pytest.importorskip("yaml")
    for item in gp.grounded_items(3):
        if item.kind == "yaml2json":
            assert yaml.safe_load(item.grounding) == json.loads(item.expected), item.id
        elif item.kind == "json2yaml":
            assert yaml.safe_load(item.expected) == json.loads(item.grounding), item.id
    tricky = {"on": {"push": None}, "version": "3.10", "port": 8443, "ok": True, "list": [], "map": {},
              "nested": [{"a": {"b": [1, "x: y"]}}, [2, 3]], "200": "yes", "url": "postgres://h:5432/db"}
    assert yaml.safe_load(gp.to_yaml(tricky)) == tricky


def test_extraction_answers_quote_whole_sentences_of_the_passage() -> None:
    for item in gp.grounded_items(3):
        if item.kind != "extract":
            continue
        flat = " ".join(item.grounding.split())
        lines = item.expected.strip().split("\n")
        assert len(lines) >= 5, item.id
        assert all(line in flat and item.meta["topic"] in line.lower() for line in lines), item.id


def test_multiturn_answers_repeat_an_earlier_assistant_turn() -> None:
    for item in gp.multiturn_items(3):
        roles = [m.role for m in item.messages]
        assert roles == ["user", "assistant", "user"], item.id
        assert item.grounding in item.messages[1].content, item.id
        assert re.search(r"\b(print|output)\b", item.messages[2].content.lower()), item.id


def test_agent_turns_resend_one_system_prompt_and_file_with_a_new_instruction() -> None:
    for family in gp.agent_families(3):
        assert len(family) == bg.CACHE_REQUESTS == 4  # the flush evicts a whole family
        assert [item.turn for item in family] == [0, 1, 2, 3]
        assert len({item.family for item in family}) == 1
        assert len({item.messages[0] for item in family}) == 1  # the same system prompt
        users = [item.messages[1].content for item in family]
        assert len(set(users)) == 4 and all(family[0].grounding in u for u in users)
        prefix = min(len(_common_prefix(users[0], u)) for u in users[1:])
        assert prefix >= len(family[0].grounding)  # the file comes first; only the task differs


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_render_uses_the_chat_template_or_role_lines() -> None:
    item = gp.multiturn_items(1)[0]

    class Plain:
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(w) for w in text.split()]}

    text = gp.render_text(item, Plain())
    assert text.startswith("user: Write a Python script") and text.endswith("assistant:")
    assert "\nassistant: Here is a script" in text
    assert gp.prompt_ids(item, Plain(), max_tokens=5) == gp.prompt_ids(item, Plain(), 10_000)[-5:]

    class Chat(Plain):
        chat_template = "yes"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "|".join(m["role"] for m in messages)

    assert gp.render_text(item, Chat()) == "user|assistant|user"
    prose = gp.Item("open/prose/0", "open", "prose", text="Once upon a time")
    assert gp.render_text(prose, Chat()) == "Once upon a time"


# ----------------------------------------------------------------------------------------------
# the run order
# ----------------------------------------------------------------------------------------------
def test_agent_families_are_one_unit_and_other_prompts_one_each() -> None:
    items = gp.workload_items(["grounded", "agent"], 2)
    units = bg.units(items)
    assert [len(u) for u in units] == [1] * 14 + [4, 4]
    assert [bg.row_of(item) for item in units[-1]] == ["agent, turn 1"] + ["agent, turns ≥ 2"] * 3
    assert bg.row_of(units[0][0]) == "grounded"
    args = SimpleNamespace(rounds=2, temperatures=[0.0, 1.0], configs=list(bg.CONFIGS))
    assert bg.generations(args, items) == 2 * 2 * 9 * 22


def test_a_round_runs_every_configuration_on_a_prompt_back_to_back() -> None:
    assert bg.phases(list(bg.CONFIGS)) == [(("A", "B"), list(bg.CONFIGS))]
    assert bg.phases(["target-only", "hf"]) == [(("B",), ["hf", "target-only"])]
    assert bg.phases(["hf", "hf-lookup"]) == [((), ["hf", "hf-lookup"])]
    assert bg.phases(["suffix", "drafter-none"]) == [(("A", "B"), ["suffix", "drafter-none"])]
    assert bg.phases([]) == []
    assert {bg.CONFIG_SERVER[c] for c in bg.CONFIGS if c not in bg.HF_CONFIGS} == {"A", "B"}


def test_servers_apart_keeps_the_two_servers_apart() -> None:
    assert bg.phases(list(bg.CONFIGS), apart=True) == [
        (("A",), ["hf", "hf-lookup", "hf-assisted", "specdec", "lookup", "suffix", "model"]),
        (("B",), ["drafter-none", "target-only"]),
    ]
    assert bg.phases(["hf", "drafter-none"], apart=True) == [((), ["hf"]), (("B",), ["drafter-none"])]
    assert bg.phases(["target-only", "hf"], apart=True) == [((), ["hf"]), (("B",), ["target-only"])]
    assert bg.phases(["suffix"], apart=True) == [(("A",), ["suffix"])]
    assert bg.parser().parse_args(["--servers-apart"]).servers_apart
    assert not bg.parser().parse_args([]).servers_apart
    assert bg.up_args("B", bg.parser().parse_args([]))[:2] == ["--drafter", "none"]
    assert "--draft" not in bg.up_args("B", bg.parser().parse_args([]))  # a usage error with none


def test_options_defaults_and_refusals(capsys) -> None:
    args = bg.parser().parse_args([])
    assert args.configs == list(bg.CONFIGS) and args.workloads == list(gp.WORKLOADS)
    assert args.temperatures == [0.0, 1.0] and args.max_new_tokens == 128 and args.rounds == 2
    assert args.per_kind == 2 and args.hf_threads == bg.default_threads() and args.lookup_tokens == 10
    assert args.cache_flush and args.serving_clients == 0 and args.dtype == "int8"
    picked = bg.parser().parse_args(["--configs", "suffix,hf", "--workloads", "agent", "--temperatures", "1",
                                     "--no-cache-flush"])
    assert picked.configs == ["hf", "suffix"]  # the fixed order
    assert picked.workloads == ["agent"] and picked.temperatures == [1.0] and not picked.cache_flush
    for bad in (["--configs", "hf,vllm"], ["--workloads", "chat"], ["--temperatures", "-1"],
                ["--temperatures", "x"]):
        with pytest.raises(SystemExit):
            bg.parser().parse_args(bad)
    with pytest.raises(SystemExit):
        bg.main(["--max-new-tokens", "0"])
    assert "--max-new-tokens must be ≥ 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# the summary and the tables
# ----------------------------------------------------------------------------------------------
def detail(config: str, item: str, tok_s: float, *, rnd: int = 0, t: float = 0.0, row: str = "grounded",
           kind: str = "rename", sources=None, iterations=None, eos_at=None) -> dict:
    d = {"round": rnd, "config": config, "temperature": t, "item": item, "workload": row.split(",")[0],
         "kind": kind, "row": row, "tok_s": tok_s, "eos_at": eos_at}
    if sources is not None:
        d["sources"] = sources
        d["iterations_by_source"] = iterations or {}
    return d


def fake_details() -> list[dict]:
    lookup = {"lookup": {"drafts": 4, "drafted_tokens": 20, "accepted_tokens": 10}}
    return [
        detail("hf", "g/0", 10.0),
        detail("hf", "g/1", 8.0),
        detail("hf", "g/0", 5.0, rnd=1),
        detail("lookup", "g/0", 20.0, sources=lookup, iterations={"lookup": 4, "none": 6}),
        detail("lookup", "g/1", 8.0, sources=lookup, iterations={"lookup": 2, "none": 8}, eos_at=3),
        detail("lookup", "g/0", 15.0, rnd=1, sources={}, iterations={"none": 10}),
        detail("hf", "a/0", 9.0, t=1.0, row="agent, turn 1", kind="agent"),
        detail("specdec", "a/0", 18.0, t=1.0, row="agent, turn 1", kind="agent",
               sources={"suffix": {"drafts": 2, "drafted_tokens": 8, "accepted_tokens": 6},
                        "model": {"drafts": 1, "drafted_tokens": 2, "accepted_tokens": 1}},
               iterations={"suffix": 2, "model": 1, "none": 1}),
    ]


def test_summary_medians_ratios_and_sources() -> None:
    summary = bg.summarize(fake_details(), ["hf", "specdec", "lookup"], [0.0, 1.0])
    assert summary["temperatures"] == ["0", "1"]
    lookup = summary["table"]["0"]["grounded"]["lookup"]
    assert lookup["n"] == 3 and lookup["tok_s"] == 15.0
    assert lookup["ratio"] == pytest.approx(2.0)  # ratios 2.0, 1.0, 3.0: per round and prompt
    assert lookup["sources"]["lookup"] == {"drafts": 8, "drafted_tokens": 40, "accepted_tokens": 20,
                                           "mean_accepted": 2.5, "acceptance": 0.5}
    assert lookup["iterations_by_source"] == {"lookup": 6, "none": 24} and lookup["eos_runs"] == 1
    assert summary["table"]["0"]["grounded"]["hf"]["ratio"] == 1.0
    assert summary["table"]["0"]["kind:grounded/rename"]["lookup"]["tok_s"] == 15.0
    agent = summary["table"]["1"]["agent, turn 1"]["specdec"]
    assert agent["ratio"] == pytest.approx(2.0) and agent["sources"]["suffix"]["mean_accepted"] == 3.0


def test_tables_render_every_row_and_configuration() -> None:
    summary = bg.summarize(fake_details(), ["hf", "specdec", "lookup"], [0.0, 1.0])
    lines = bg.render_tables(summary)
    assert "| grounded | 8.00 | – | 15.00 (2.00×) |" in lines
    assert "| grounded/rename | 8.00 | – | 15.00 (2.00×) |" in lines
    assert "| agent, turn 1 | 9.00 | 18.00 (2.00×) | – |" in lines
    assert "| grounded | lookup | – | 2.50 / 0.50 (8) | – | none 80%, lookup 20% |" in lines
    assert ("| agent, turn 1 | specdec | 1.00 / 0.50 (1) | – | 3.00 / 0.75 (2) | "
            "suffix 50%, model 25%, none 25% |") in lines
    assert any(line.startswith("1 of 6 runs produced an EOS token") for line in lines)
    meta = {"date": "d", "command": "python -m bench.bench_grounded --rounds 1", "machine": "m",
            "draft": "dr", "target": "ta", "dtype": "int8", "max_new_tokens": 128, "temperatures": ["0", "1"],
            "rounds": 1,
            "per_kind": 2, "workloads": ["grounded"], "hf_threads": 2, "configs": ["hf", "suffix"],
            "cache_flush": True, "cache_requests": 4}
    names = ("specdec_batches_total", "specdec_batch_calls_total", "specdec_batch_tokens_total",
             "specdec_batch_positions_total", "specdec_batch_seconds_total", "specdec_emitted_tokens_total",
             "specdec_source_drafted_tokens_total{suffix}", "specdec_source_accepted_tokens_total{suffix}")
    before = dict(zip(names, (10.0, 20.0, 100.0, 60.0, 5.0, 30.0, 10.0, 5.0), strict=True))
    after = dict(zip(names, (20.0, 60.0, 300.0, 160.0, 9.0, 130.0, 50.0, 25.0), strict=True))
    passes = bg.pass_summary(before, after)
    assert (passes["passes"], passes["calls_per_pass"], passes["rows_per_pass"]) == (10.0, 4.0, 20.0)
    assert passes["padding_share"] == 0.5 and passes["seconds_per_pass"] == 0.4
    assert passes["emitted_per_row"] == 0.5 and passes["acceptance_by_source"] == {"suffix": 0.5}
    serving = {"clients": 8, "seconds": 300.0, "prompts": 14, "levels": [
        {"config": "drafter-none", "temperature": 0.0, "aggregate_tok_s": 12.5, "request_tok_s_p50": 1.6,
         "latency_p50_s": 80.0, "ttft_p50_s": 6.04, "itl_p50_s": 0.412, "itl_p99_s": 0.9, "requests": 16,
         "errors": 0, "repeats": 2,
         "passes": passes},
        {"config": "specdec", "temperature": 0.0, "aggregate_tok_s": 6.0, "request_tok_s_p50": 0.8,
         "latency_p50_s": 160.0, "requests": 8, "errors": 0, "repeats": 1}]}
    text = bg.render({"summary": summary, "serving": serving}, meta)
    assert "Command: `python -m bench.bench_grounded --rounds 1`" in text
    assert "SPECDEC_SUFFIX_CACHE_REQUESTS=4" in text
    assert "| drafter-none | 0 | 12.50 | 1.60 | 80.00 | 6.0 | 0.412 | 0.900 | 16 | 0 | 2 |" in text
    assert "| specdec | 0 | 6.00 | 0.80 | 160.00 | – | – | – | 8 | 0 | 1 |" in text  # a level of an older run
    assert "| drafter-none | 0 | 10 | 4.00 | 20.0 | 50% | 0.400 | 50 | 0.50 |" in text
    assert "suffix cache" not in bg.render({"summary": summary}, {**meta, "configs": ["hf", "lookup"]})


# ----------------------------------------------------------------------------------------------
# one run of the HF rows on the tiny pair
# ----------------------------------------------------------------------------------------------
def test_hf_rows_end_to_end_on_the_tiny_pair(tiny_dirs, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["--configs", "hf,hf-lookup,hf-assisted", "--workloads", "multiturn,agent", "--per-kind", "1",
            "--rounds", "1", "--temperatures", "0,1", "--max-new-tokens", "4", "--max-prompt-tokens", "24",
            "--dtype", "float32", "--hf-threads", "1", "--warmup-tokens", "2",
            "--draft", str(tiny_dirs["draft"]), "--target", str(tiny_dirs["target"]), "--out", str(out)]
    assert bg.main(argv) == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["meta"]["command"].startswith("python -m bench.bench_grounded --configs hf,hf-lookup")
    details = saved["details"]
    assert len(details) == 2 * 3 * (1 + 4)  # temperatures × configurations × (1 chat + 4 agent turns)
    assert all(d["tokens"] == 4 and d["tok_s"] > 0 and d["prompt_tokens"] == 24 for d in details)
    # the interleaving: one agent family is one unit, every configuration walks its turns in order
    agent = [(d["config"], d["turn"]) for d in details if d["workload"] == "agent" and d["temperature"] == 0]
    assert agent == [(c, t) for c in ("hf", "hf-lookup", "hf-assisted") for t in range(4)]
    table = (out / "grounded.md").read_text()
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")]
    assert rows.count("| multiturn") == 2 and rows.count("| agent, turns ≥ 2") == 2
    captured = capsys.readouterr()  # the table on stdout, progress on stderr
    assert "| workload | hf | hf-lookup | hf-assisted |" in captured.out
    assert "round 0 multiturn/0 T=0 hf-lookup: " in captured.err and "round 0" not in captured.out


def _span(name, span_id, parent, start_ms, end_ms, kind="INTERNAL", **attributes):
    return {"name": name, "span_id": span_id, "parent_span_id": parent, "kind": kind,
            "start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6), "attributes": attributes}


def test_the_breakdown_splits_each_configurations_iterations_from_the_servers_spans(tmp_path) -> None:
    """Two target-only iterations of 80 ms: 70 ms forward, 2 verification, 1 engine, 1 handler, 3 wire."""
    request = {"specdec.request_id": "grounded-9-target-only-3"}
    spans = [_span("specdec.request", "r", None, 0, 200, **request),
             _span("specdec.request", "w", None, 0, 10, **{"specdec.request_id": "grounded-9-warmup-1"})]
    for i, start in enumerate((0, 100)):
        spans += [
            _span("specdec.iteration", f"i{i}", "r", start, start + 80, **{"specdec.emitted": 1}),
            _span("specdec.verify", f"v{i}", f"i{i}", start + 1, start + 79),
            _span("/specdec.v1.VerifierService/Verify", f"c{i}", f"v{i}", start + 2, start + 79, "CLIENT"),
            _span("/specdec.v1.VerifierService/Verify", f"s{i}", f"c{i}", start + 4, start + 78, "SERVER"),
            _span("verifier.verify", f"e{i}", f"s{i}", start + 4.5, start + 77.5),
            _span("verifier.forward", f"f{i}", f"e{i}", start + 5, start + 75),
            _span("verifier.verification", f"g{i}", f"e{i}", start + 75, start + 77),
        ]
    (tmp_path / "trace-B-r0.jsonl").write_text("\n".join(json.dumps(s) for s in spans[:9]))
    (tmp_path / "trace-B-r1.jsonl").write_text("\n".join(json.dumps(s) for s in spans[9:]))
    breakdown = bg.iteration_breakdown(tmp_path)
    assert list(breakdown) == ["target-only"]  # warm-ups are no configuration
    row = breakdown["target-only"]
    assert row["iterations"] == 2 and row["iteration_ms"] == pytest.approx(80)
    verify = row["calls"]["Verify"]
    assert verify["count"] == 2 and verify["compute"] == pytest.approx(72)
    assert verify["engine"] == pytest.approx(1) and verify["handler"] == pytest.approx(1)
    assert verify["wire"] == pytest.approx(3) and verify["loop"] == pytest.approx(1)
    text = "\n".join(bg.render_breakdown(breakdown))
    assert "| target-only | 2 | 80.00 |" in text and "| Verify | 2 | 72.00 | 1.00 | 1.00 | 3.00 |" in text


def test_hf_rows_can_run_at_plain_hfs_per_tensor_int8(tiny_dirs) -> None:
    import torch

    loaded = bg.load_hf_target(tiny_dirs["target"], bg.PER_TENSOR, 1)
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    assert any(isinstance(m, dynamic) for m in loaded.model.modules())
    with torch.no_grad():
        assert loaded.model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == loaded.info.vocab_size
