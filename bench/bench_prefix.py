"""Prefill once: time to first token per turn of a multi-turn chat, with the prefix cache and without,
against the prefill of each turn's new tokens alone (issue 38's chat goal).

    python -m bench.bench_prefix --rounds 2 --out bench/results/prefix-DATE

One `specdec up` (the default pair, int8) serves it all over its HTTP door, through the official
`openai` package, streamed (TTFT = the first chunk with text). A coding chat of --turns user turns is
first played once to fix the assistant's answers (T = 0, --max-tokens each). Then, per round and in
this order, each turn n is sent as the whole conversation so far (what a chat client resends):

    cached   under one cache_salt for the whole chat: turn n finds turn n − 1's prompt and answer
    cold     under a fresh cache_salt per turn: no block of anything sent before is found (what the
             service did before the prefix cache; the salt is the tenant boundary, docs/algorithms.md
             §16)
    new      only turn n's new tokens (the completions door, token ids), fresh salt: the prefill of the
             new tokens alone, which the goal compares the cached TTFT with

Every request asks for --max-tokens tokens, so each one's first iteration has the same shape (a
request for one token would skip drafting and answer sooner). Each waits --think-seconds first, as a
chat's next turn comes after its user has read the answer: what the service does while idle (the
close of a chat turn, docs/algorithms.md §16) is then done, as it would be between a person's turns.
Reported per turn: prompt tokens, new tokens, the median TTFT of each, cached/new and cold/cached,
and the usage's `prompt_tokens_details.cached_tokens`. The machine is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.bench_iteration import start_up, stop_up
from bench.bench_serving import free_port
from bench.machine import cpu_model
from specdec.trees import common_prefix

CHAT = (
    "Write a Python function `parse_duration(text)` that turns strings like '1h30m', '45s' or '2h' into "
    "a number of seconds. Keep it short.",
    "Now make it accept days too ('3d4h'), and raise ValueError with a clear message on bad input.",
    "Add a docstring with three examples in doctest form.",
    "Write pytest tests for it: valid inputs, the largest unit first, and two invalid inputs.",
    "Finally, rename the function to `duration_seconds` everywhere, in the code and the tests.",
)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def streamed(client, *, chat: list[dict[str, str]] | None, prompt_ids: list[int] | None, max_tokens: int,
             salt: str, model: str) -> dict[str, Any]:
    """One streamed request: TTFT, the text, and the usage's cached tokens."""
    extra = {"cache_salt": salt}
    options = {"include_usage": True}
    began = time.perf_counter()
    if chat is not None:
        stream = client.chat.completions.create(model=model, messages=chat, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options=options,
                                                extra_body=extra)
    else:
        stream = client.completions.create(model=model, prompt=prompt_ids, max_tokens=max_tokens,
                                           temperature=0, stream=True, stream_options=options,
                                           extra_body=extra)
    first, text, usage = None, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat is not None else choice.text
            if piece:
                text.append(piece)
                first = first if first is not None else time.perf_counter() - began
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {"ttft": first if first is not None else time.perf_counter() - began, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details is not None else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    from specdec.models import resolve_model
    from specdec.runtime.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.target))
    args.out.mkdir(parents=True, exist_ok=True)
    http_port = free_port()
    up_args = ["--draft", args.draft, "--target", args.target, "--dtype", args.dtype,
               "--http-port", str(http_port), *args.up_args]
    say(f"starting specdec up {' '.join(up_args)}")
    trace = args.out / "trace.jsonl" if args.trace else None
    process = start_up(trace, args.out / "up.ready.json", args.out / "up.log", up_args)
    try:
        info = json.loads((args.out / "up.ready.json").read_text())
        client = openai.OpenAI(base_url=f"{info['http'].rstrip('/')}/v1", api_key="none", timeout=600)
        model = client.models.list().data[0].id
        # Play the chat once: the answers every later run resends.
        chat: list[dict[str, str]] = []
        conversations: list[list[dict[str, str]]] = []
        for message in CHAT[:args.turns]:
            chat = chat + [{"role": "user", "content": message}]
            conversations.append(chat)
            answer = streamed(client, chat=chat, prompt_ids=None, max_tokens=args.max_tokens,
                              salt=f"play-{uuid.uuid4().hex}", model=model)["text"]
            chat = chat + [{"role": "assistant", "content": answer}]
            say(f"played turn {len(conversations)}: {len(answer)} characters")

        def render(messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                tokenize=True)
            return list(getattr(out, "input_ids", out))

        ids = [render(c, True) for c in conversations]
        # Turn n's new tokens: after what the chat held before them (the last prompt and its answer).
        news = [ids[0]] + [ids[n][common_prefix(ids[n], render(chat[:2 * n], False)):]
                           for n in range(1, len(ids))]
        rows: list[dict[str, Any]] = []

        def after_a_pause(**request: Any) -> dict[str, Any]:
            time.sleep(args.think_seconds)
            return streamed(client, max_tokens=args.max_tokens, model=model, **request)

        for rnd in range(args.rounds):
            salt = f"chat-{rnd}-{uuid.uuid4().hex}"
            for turn, conversation in enumerate(conversations):
                new_ids = news[turn]
                cached = after_a_pause(chat=conversation, prompt_ids=None, salt=salt)
                cold = after_a_pause(chat=conversation, prompt_ids=None, salt=f"cold-{uuid.uuid4().hex}")
                new = after_a_pause(chat=None, prompt_ids=new_ids, salt=f"new-{uuid.uuid4().hex}")
                row = {"round": rnd, "turn": turn + 1, "prompt_tokens": len(ids[turn]),
                       "new_tokens": len(new_ids),
                       "ttft_cached": cached["ttft"], "ttft_cold": cold["ttft"], "ttft_new": new["ttft"],
                       "cached_tokens": cached["cached_tokens"], "cold_cached_tokens": cold["cached_tokens"]}
                rows.append(row)
                say(json.dumps(row))
    finally:
        stop_up(process)
    return {"machine": f"{cpu_model()}, 2 threads per engine", "command": " ".join(sys.argv),
            "up_args": up_args, "think_seconds": args.think_seconds, "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        mine = [r for r in rows if r["turn"] == turn]
        med = {key: statistics.median(r[key] for r in mine)
               for key in ("ttft_cached", "ttft_cold", "ttft_new")}
        out.append({"turn": turn, "prompt_tokens": mine[0]["prompt_tokens"],
                    "new_tokens": mine[0]["new_tokens"],
                    **med, "cached_over_new": med["ttft_cached"] / med["ttft_new"],
                    "cold_over_cached": med["ttft_cold"] / med["ttft_cached"],
                    "cached_tokens": mine[0]["cached_tokens"]})
    return out


def render(results: dict[str, Any]) -> str:
    lines = [f"Machine: {results['machine']}. Command: `{results['command']}`.", "",
             "| turn | prompt tokens | new tokens | cached tokens (usage) | TTFT cold (s) | TTFT cached (s) "
             "| TTFT of the new tokens alone (s) | cached / new alone | cold / cached |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in results["summary"]:
        lines.append(f"| {s['turn']} | {s['prompt_tokens']} | {s['new_tokens']} | {s['cached_tokens']} | "
                     f"{s['ttft_cold']:.2f} | {s['ttft_cached']:.2f} | {s['ttft_new']:.2f} | "
                     f"{s['cached_over_new']:.2f}× | {s['cold_over_cached']:.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--turns", type=int, default=len(CHAT), choices=range(1, len(CHAT) + 1))
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens of each assistant answer")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--think-seconds", type=float, default=1.0,
                        help="pause before each measured request: a chat's user reads the answer and "
                        "types, and the service idles meanwhile (0: back to back, as before 2026-12-02)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefix"))
    parser.add_argument("--trace", action="store_true",
                        help="spans of every service to OUT/trace.jsonl (what each first iteration did)")
    parser.add_argument("--up-args", nargs=argparse.REMAINDER, default=[],
                        help="more `specdec up` options (last on the line)")
    args = parser.parse_args(argv)
    results = run(args)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "prefix.md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
