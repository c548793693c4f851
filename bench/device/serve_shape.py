"""A drafter or verifier of a model shape (random weights built on the device) behind its real gRPC
server, in a process of its own: the loop step's two services. The shapes have no checkpoint to
load, so `specdec serve` cannot serve them; everything past loading is the same code.

    python -m bench.device.serve_shape --role verifier --shape qwen2.5-7b --ready-file F [--no-cuda-graphs]

Writes {"port": N} to --ready-file once serving (and captured), then serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("drafter", "verifier"), required=True)
    parser.add_argument("--shape", required=True, help="a name in bench.device.shapes.CONFIGS")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the shape's vocabulary")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-layers", type=int, default=None,
                        help="keep only the shape's first N layers (a self-draft of the shape, same seed)")
    parser.add_argument("--damp", default=None, metavar="N:S",
                        help="scale layers N..'s output projections by S (bench.device.shapes.build_model)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--slot-tokens", type=int, default=1024)
    parser.add_argument("--ready-file", type=Path, required=True, help="gets {\"port\": N} once serving")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    from bench.device.shapes import loaded_model
    from specdec.rpc.grpc_support import freeze_startup_objects
    from specdec.runtime.batch_config import BatchConfig
    from specdec.runtime.compute_thread import ComputeThread, serial_torch
    from specdec.runtime.kv_pool import PoolConfig
    from specdec.runtime.tiny import build_tokenizer

    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)
    compute = ComputeThread()
    vocab = args.vocab_size
    tokenizer = build_tokenizer(16) if args.role == "drafter" else None  # the verifier detokenizes
    damp = (int(args.damp.split(":")[0]), float(args.damp.split(":")[1])) if args.damp else None
    loaded = compute.call(loaded_model, args.shape, args.device, args.dtype, args.seed, tokenizer, vocab,
                          args.keep_layers, damp)
    loaded.compute = compute
    pool = (PoolConfig(slots=args.slots, slot_tokens=args.slot_tokens, capture=args.device.startswith("cuda"))
            if args.cuda_graphs else None)
    if args.role == "drafter":
        from drafter_service.server import start_drafter_server as start
        from specdec.engine.drafter import DrafterEngine as Engine
    else:
        from specdec.engine.verifier import VerifierEngine as Engine
        from verifier_service.server import start_verifier_server as start
    engine = Engine(loaded, batching=BatchConfig(), kv_pool=pool)
    if engine.pool is not None:
        report = engine.pool.report
        print(f"{args.role}: {report.graphs} graphs captured in {report.seconds:.1f} s, "
              f"{report.graph_bytes / 2**20:.0f} MiB graph memory, "
              f"KV pool {report.pool_bytes / 2**20:.0f} MiB",
              file=sys.stderr, flush=True)

    async def serve() -> None:
        server, port = await start(engine, "127.0.0.1", 0, max_workers=engine.batching.workers,
                                   worker_initializer=serial_torch)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        freeze_startup_objects()  # as `specdec serve` does before it says it is ready
        args.ready_file.write_text(json.dumps({"port": port}))
        await stop.wait()
        await server.stop(0)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
