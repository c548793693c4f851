"""Options of the whole suite: the torch device of the tests that take one.

Tests marked `device` load their models on SPECDEC_TEST_DEVICE (tests.helpers.device_under_test):
"cpu" by default, so they run here; on a GPU machine `SPECDEC_TEST_DEVICE=cuda pytest -m device`
(or `pytest --test-device cuda -m device`) runs the same assertions on CUDA (docs/gpu.md).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import TEST_DEVICE_VARIABLE, device_under_test


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--test-device", default=None, metavar="DEVICE",
                     help=f"torch device of the tests marked `device` (sets ${TEST_DEVICE_VARIABLE}; "
                          "default cpu): cpu, cuda, cuda:N or mps")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"device: loads its models on ${TEST_DEVICE_VARIABLE} (default cpu; "
                                       "cuda on a GPU machine): select them with -m device")
    given = config.getoption("--test-device")
    if given:
        os.environ[TEST_DEVICE_VARIABLE] = given  # subprocesses of the tests see it too
    try:
        device = device_under_test()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if device.startswith("cuda"):  # a device that is not there is an error, never a silent CPU run
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            raise pytest.UsageError(f"{TEST_DEVICE_VARIABLE}={device}: torch {torch.__version__} sees "
                                    f"{count} CUDA device(s)")


def pytest_report_header(config: pytest.Config) -> str:
    return f"test device: {device_under_test()} (${TEST_DEVICE_VARIABLE}; tests marked `device`)"
