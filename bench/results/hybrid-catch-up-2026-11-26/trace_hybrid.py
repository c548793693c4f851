"""Per-iteration timings: hybrid vs suffix on server A, grounded prompts, T=0."""
import asyncio, json, statistics, sys
from pathlib import Path
sys.path.insert(0, "/work/main")
from bench import bench_grounded as bg
from bench.grounded_prompts import workload_items, prompt_ids

args = bg.parser().parse_args(["--configs", "specdec,suffix", "--workloads", "grounded,open", "--per-kind", "1",
                               "--rounds", "1", "--temperatures", "0", "--out", "/tmp/exp/th"] + sys.argv[2:])
args.out.mkdir(parents=True, exist_ok=True)
from transformers import AutoTokenizer
from specdec.models import resolve_model
KINDS = sys.argv[1].split(",")

def main():
    spec = bg.start_server("A", "A", args, bg.CACHE_REQUESTS, print)
    try:
        asyncio.run(go(spec.info["orchestrator"]))
    finally:
        spec.stop()

async def go(address):
    from specdec.client import AsyncClient
    from specdec.generation import GenerationRequest
    from specdec.sampling_params import SamplingParams
    items = [i for w in workload_items(["grounded", "open"], 1).values() for i in w if i.kind in KINDS]
    import specdec.runtime.loading as L
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.target)))
    client = AsyncClient(address, timeout_s=600)
    out = []
    for item in items:
        ids = prompt_ids(item, tokenizer)
        await bg.specdec_run(client, "specdec", ids, 8, 0.0, f"warm-{item.id}")
        for rep in range(2):
            for config in ("specdec", "suffix"):
                await bg.flush_cache(client, bg.CACHE_REQUESTS, f"flush-{config}-{rep}-{item.id}")
                req = GenerationRequest(prompt_ids=list(ids), max_new_tokens=128, sampling=SamplingParams(temperature=0.0),
                                        stop_token_ids=[], draft_source=bg.REQUEST_SOURCE[config], request_id=f"{config}-{rep}-{item.id}")
                import time
                t0 = time.time()
                res = await client.generate(req)
                t1 = time.time()
                its = [dict(source=r.source or "none", k=r.k, nd=r.num_drafted, acc=r.accepted, n=len(r.emitted),
                            start=r.start - t0, end=r.end - t0,
                            draft=[(a - t0, b - t0) for a, b in r.draft_intervals],
                            verify=[(a - t0, b - t0) for a, b in r.verify_intervals]) for r in res.iterations]
                out.append(dict(item=item.id, config=config, rep=rep, total=t1 - t0, prompt=len(ids), its=its))
                first = its[0]["start"] if its else None
                by = {}
                for it in its:
                    d = by.setdefault(it["source"], [0, 0.0, 0])
                    d[0] += 1; d[1] += it["end"] - it["start"]; d[2] += it["n"]
                gaps = sum(max(0.0, b["start"] - a["end"]) for a, b in zip(its, its[1:]))
                print(f"{item.id} {config} rep{rep}: total {t1-t0:.2f}s prompt {len(ids)} first-it-start {first:.2f}s "
                      f"last-end {its[-1]['end']:.2f} gaps {gaps:.2f}s " +
                      " ".join(f"{s}: {c} its {tt:.2f}s {n} tok ({tt/c*1000:.0f} ms/it)" for s, (c, tt, n) in by.items()), flush=True)
    Path("/tmp/exp/th/iters.json").write_text(json.dumps(out))
    await client.close()

main()
