"""The verifier's passes of two served target-only requests, with the orchestrator scoring ahead or not.

    PYTHONPATH=. python bench/results/zen4-2026-12-04/pass_gaps/run_diag.py OUT true
    PYTHONPATH=. python bench/results/zen4-2026-12-04/pass_gaps/run_diag.py OUT false
    python bench/results/zen4-2026-12-04/pass_gaps/parse.py OUT/passes-true.log OUT/passes-false.log
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = ["The history of the printing press begins", "def quicksort(items):"]


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 300
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear")
        time.sleep(0.5)


async def requests(ahead: str) -> None:
    from specdec.client import AsyncClient
    from specdec.generation import GenerationRequest
    from specdec.sampling_params import SamplingParams

    client = AsyncClient("127.0.0.1:50072", timeout_s=300)
    for i, prompt in enumerate(PROMPTS):
        request = GenerationRequest(prompt=prompt, max_new_tokens=64,
                                    sampling=SamplingParams(temperature=0.0), stop_token_ids=[],
                                    method="autoregressive", request_id=f"d{i}-{time.time()}",
                                    cache_salt=f"d{i}-{time.time()}")
        began = time.perf_counter()
        result = await client.generate(request)
        per_iteration = (time.perf_counter() - began) / result.stats.iterations
        print(ahead, i, f"{per_iteration * 1e3:.1f} ms/it", flush=True)
    await client.close()


def main() -> None:
    out, ahead = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PASS_LOG=str(out / f"passes-{ahead}.log"), HF_HUB_OFFLINE="1",
               MALLOC_ARENA_MAX="2")
    v_ready, o_ready = out / "v.json", out / "o.json"
    for path in (v_ready, o_ready):
        path.unlink(missing_ok=True)
    verifier = subprocess.Popen(
        [sys.executable, str(HERE / "patched_verifier.py"), "--model", "qwen2.5-coder-1.5b",
         "--dtype", "int8", "--port", "50071", "--threads", "2", "--ready-file", str(v_ready)],
        env=env, stdout=(out / "v.log").open("w"), stderr=subprocess.STDOUT)
    wait_for(v_ready)
    orchestrator = subprocess.Popen(
        ["specdec", "serve", "orchestrator", "--drafter", "none", "--verifier", "127.0.0.1:50071", "--port",
         "50072", "--ready-file", str(o_ready)],
        env=dict(env, SPECDEC_SCORE_AHEAD=ahead), stdout=(out / "o.log").open("w"), stderr=subprocess.STDOUT)
    wait_for(o_ready)
    try:
        asyncio.run(requests(ahead))
    finally:
        for process in (orchestrator, verifier):
            process.send_signal(signal.SIGTERM)
            process.wait(30)


if __name__ == "__main__":
    main()
