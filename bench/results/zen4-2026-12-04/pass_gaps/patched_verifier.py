"""`specdec serve verifier` with timestamps of its passes and calls, one line each to $PASS_LOG (a
diagnostic: run_diag.py starts it)."""

import os
import sys
import threading
import time

import specdec.engine.verifier as verifier
import specdec.runtime.batching as batching
from specdec.cli.main import main

LOG = open(os.environ["PASS_LOG"], "w", buffering=1)  # noqa: SIM115 - lives as long as the process


def mark(name: str) -> None:
    LOG.write(f"{name} {time.perf_counter():.6f} {threading.current_thread().name}\n")


def marked(cls, attribute: str, enter: str, leave: str | None = None) -> None:
    original = getattr(cls, attribute)

    def wrapper(*args):
        mark(enter)
        try:
            return original(*args)
        finally:
            if leave:
                mark(leave)

    setattr(cls, attribute, wrapper)


marked(batching.ForwardBatcher, "_execute", "pass_begin", "pass_end")
marked(verifier.VerifierEngine, "verify", "verify_enter", "verify_exit")
marked(verifier.VerifierEngine, "_score_ahead", "ahead_enter", "ahead_exit")
marked(verifier.VerifierEngine, "_forward", "forward_call")
sys.argv = ["specdec", "serve", "verifier", *sys.argv[1:]]
main()
