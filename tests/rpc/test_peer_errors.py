"""A peer's failure, passed on by a server, names the peer's service but not its address (issue 14):
the address stays in the exception (str(), `address`) for the server's log."""

from __future__ import annotations

import grpc
import pytest

from specdec.errors import InvalidRequest, PeerUnavailable
from specdec.rpc.status import RemoteError, error_from_status, status_for, without_addresses

ADDRESS = "10.1.2.3:50052"
REFUSED = f"failed to connect to all addresses; last error: UNKNOWN: ipv4:{ADDRESS}: Connection refused"


# CANCELLED: the peer's server stopped with the call in flight (tests/orchestrator/test_health.py)
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.CANCELLED])
def test_an_unreachable_peer_is_named_by_its_service(code) -> None:
    error = error_from_status(code, REFUSED, ADDRESS, service="verifier")
    assert isinstance(error, PeerUnavailable) and error.address == ADDRESS
    assert str(error) == f"{ADDRESS} unavailable ({code.name}): {REFUSED}"  # the log's text
    public = (f"verifier unavailable ({code.name}): failed to connect to all addresses; last error: UNKNOWN: "
              "<address>: Connection refused")
    assert status_for(error) == (grpc.StatusCode.UNAVAILABLE, public)
    unnamed = error_from_status(code, "", ADDRESS)
    assert status_for(unnamed)[1] == f"upstream service unavailable ({code.name})"


def test_other_peer_statuses_pass_on_without_the_address() -> None:
    details = "internal error (details in the server log)"
    internal = error_from_status(grpc.StatusCode.INTERNAL, details, ADDRESS, service="drafter")
    assert isinstance(internal, RemoteError) and internal.details == details
    assert status_for(internal) == (grpc.StatusCode.INTERNAL, f"RemoteError: drafter: INTERNAL: {details}")
    assert ADDRESS in str(internal)
    # A peer's own answers carry no address: passed on as they are.
    invalid = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "k must lie in 0..128", ADDRESS)
    assert isinstance(invalid, InvalidRequest) and status_for(invalid)[1] == "k must lie in 0..128"


@pytest.mark.parametrize("text", [
    "ipv4:127.0.0.1:50051: Failed", "ipv6:%5B::1%5D:50051: Failed", "at [::1]:50051 now",
    "host db-1:6379 down", "peer 192.168.0.7 gone", "unix:/tmp/specdec.sock: refused",
])
def test_addresses_are_masked(text) -> None:
    masked = without_addresses(text)
    assert "<address>" in masked
    for part in ("127.0.0.1", "::1", "50051", "6379", "192.168", "/tmp/specdec.sock"):
        assert part not in masked, masked
    plain = "temperature must lie in (0, 1]: got 2"
    assert without_addresses(plain) == plain
