"""The malloc thresholds a model process raises, and when it leaves them alone."""

from __future__ import annotations

import platform

import pytest

from specdec.runtime import allocator


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(allocator, "_tuned", None)
    for name in ("GLIBC_TUNABLES", allocator.TUNING_ENV, "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds_once(fresh):
    calls = []
    real = allocator.ctypes.CDLL

    class Recording:
        def __init__(self, name):
            assert name is None  # the process's own symbols, no ldconfig child
            self._libc = real(name)

        def mallopt(self, parameter, value):
            calls.append((parameter, value))
            return self._libc.mallopt(parameter, value)

    fresh.setattr(allocator.ctypes, "CDLL", Recording)
    assert allocator.keep_freed_memory() is True
    assert calls == [(-3, allocator.MMAP_THRESHOLD), (-1, allocator.TRIM_THRESHOLD)]
    assert allocator.keep_freed_memory() is True and len(calls) == 2  # once per process


@pytest.mark.parametrize(("name", "value"), [(allocator.TUNING_ENV, "0"), (allocator.TUNING_ENV, "off"),
                                             ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1"),
                                             ("MALLOC_MMAP_THRESHOLD_", "65536")])
def test_opt_out_and_a_users_own_settings_are_left_alone(fresh, name, value):
    fresh.setenv(name, value)
    fresh.setattr(allocator.ctypes, "CDLL", lambda name: pytest.fail("mallopt must not be called"))
    assert allocator.keep_freed_memory() is False


@pytest.mark.parametrize("call", [allocator.keep_freed_memory, allocator.release_freed_memory])
def test_a_libc_without_mallopt_or_malloc_trim_is_no_error(fresh, call):
    class NotGlibc:
        def __init__(self, name):
            pass

    fresh.setattr(allocator.ctypes, "CDLL", NotGlibc)
    assert call() is False


def _anonymous_kib() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["RssAnon"].split()[0])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_load_gives_back_what_it_freed(fresh):
    """With the thresholds raised, freed blocks stay in the heap (what a quantising load frees:
    gigabytes of float weights); `release_freed_memory` returns them to the kernel."""
    allocator.keep_freed_memory()
    blocks = [bytearray(8 << 20) for _ in range(40)]  # 320 MiB from the heap, pages touched
    pin = bytearray(1024)  # a live block above them: the heap's top cannot simply shrink
    held = _anonymous_kib()
    del blocks
    assert _anonymous_kib() > held - (100 << 10)  # still resident after the free
    assert allocator.release_freed_memory() is True
    assert _anonymous_kib() < held - (250 << 10)
    del pin
