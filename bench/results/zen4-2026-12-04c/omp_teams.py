"""How many threads of each served engine burn CPU: the compute thread, its OpenMP helper, and any
helper of a second OpenMP team (runtime.compute_thread: a pool thread whose torch count was started
after a count of two was set). `up --drafter none` and default `up`, a few requests each, some of
them concurrent so that the gRPC worker pools grow.

    PYTHONPATH=. python bench/results/zen4-2026-12-04c/omp_teams.py OUT_DIR
"""

import asyncio
import os
import sys
from pathlib import Path

from bench.bench_grounded import parser, specdec_run, start_server

TICKS = os.sysconf("SC_CLK_TCK")


def busy_threads(pid: int) -> list[tuple[str, float]]:
    """(thread name, CPU seconds) of every thread of `pid` that used more than 0.2 s."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / TICKS
        if cpu > 0.2:
            out.append((name, round(cpu, 1)))
    return sorted(out, key=lambda item: -item[1])


async def load(address: str, ids: list[int]) -> None:
    from specdec.client import AsyncClient

    client = AsyncClient(address, timeout_s=600)
    try:
        for config in ("target-only", "drafter-none"):
            await specdec_run(client, config, ids, 24, 0.0, f"teams-{config}")
        # four at once: the servers' worker pools start more threads
        await asyncio.gather(*(specdec_run(client, "drafter-none", ids, 16, 1.0, f"teams-c{n}")
                               for n in range(4)))
    finally:
        await client.close()


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    args = parser().parse_args(["--out", str(out)])  # the side-by-side's defaults: pair, int8, no trace
    ids = [(1000 + (i * 37) % 5000) for i in range(200)]
    for server in ("B", "A"):
        spec = start_server(server, f"teams-{server}", args, None, print)
        try:
            asyncio.run(load(spec.info["orchestrator"], ids))
            for name, pid in spec.info.get("pids", {}).items():
                threads = busy_threads(int(pid))
                print(server, name, f"{len(list(Path(f'/proc/{pid}/task').iterdir()))} threads;",
                      "busy:", threads, flush=True)
        finally:
            spec.stop()


if __name__ == "__main__":
    main()
