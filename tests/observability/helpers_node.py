"""One specdec service process for the observability tests, wired the way the CLI wires it.

    python -m tests.observability.helpers_node ROLE --ready-file F [--model DIR] [--sleep S]
        [--drafter ADDR --verifier ADDR] [--trace-file F] [--otlp-endpoint E] [--metrics-port P]

ROLE is drafter, verifier or orchestrator. --sleep slows every forward pass of the model by S
seconds (so that concurrency shows on a tiny model). Observability comes from
specdec.cli.observability.setup_observability, the same set-up `specdec serve` uses; the
process stops cleanly on SIGTERM (flushing its spans) and prints "clean exit".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["drafter", "verifier", "orchestrator"])
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--model")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--drafter")
    parser.add_argument("--verifier")
    parser.add_argument("--trace-file")
    parser.add_argument("--otlp-endpoint")
    parser.add_argument("--metrics-port", type=int)
    args = parser.parse_args()

    from specdec.cli.observability import setup_observability
    from specdec.cli.processes import write_ready_file
    from specdec.rpc.grpc_support import freeze_startup_objects, serve_until_signal

    obs = setup_observability(args.role, trace_file=args.trace_file, otlp_endpoint=args.otlp_endpoint,
                              metrics_port=args.metrics_port)

    async def serve() -> None:
        if args.role == "orchestrator":
            from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
            from orchestrator.config import OrchestratorConfig
            from orchestrator.server import start_orchestrator_server
            from orchestrator.speculation import Orchestrator

            orchestrator = Orchestrator(
                GrpcDrafterClient(args.drafter, interceptors=obs.client_interceptors),
                GrpcVerifierClient(args.verifier, interceptors=obs.client_interceptors),
                OrchestratorConfig(), observer=obs.loop_observer)
            await orchestrator.start()
            server, port = await start_orchestrator_server(orchestrator, "127.0.0.1", 0,
                                                           interceptors=obs.server_interceptors)
            closing = orchestrator.close
        else:
            from specdec.runtime.loading import load_model

            loaded = load_model(args.model, threads=1)
            if args.sleep > 0:
                loaded.model.register_forward_pre_hook(lambda module, inputs: time.sleep(args.sleep))
            if args.role == "drafter":
                from drafter_service.server import start_drafter_server as start
                from specdec.engine.drafter import DrafterEngine as Engine
            else:
                from specdec.engine.verifier import VerifierEngine as Engine
                from verifier_service.server import start_verifier_server as start
            from specdec.runtime.prefix_cache import PrefixStore

            engine = Engine(loaded, prefix_cache=PrefixStore(64 << 20))  # as `serve` has one by default
            obs.watch_engine(engine)
            server, port = await start(engine, "127.0.0.1", 0, interceptors=obs.server_interceptors,
                                       observers=obs.service_observers)
            closing = None
        freeze_startup_objects()  # as `specdec serve` does before it says it is ready
        write_ready_file(args.ready_file, {"address": f"127.0.0.1:{port}", "port": port, "pid": os.getpid(),
                                           **obs.ready_info()})
        await serve_until_signal(server, grace_s=2.0)
        if closing is not None:
            await closing()

    try:
        asyncio.run(serve())
    finally:
        obs.shutdown()
    print("clean exit", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
