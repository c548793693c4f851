"""Loading a causal LM + tokenizer from a local HF directory or a .gguf file.

GGUF files are dequantised by transformers, which takes about a minute for a 1B model. We do
it once per file and keep the result as an ordinary safetensors directory under the specdec
home (``$SPECDEC_HOME`` or ``~/.cache/specdec``), keyed by the file's sha256, so later starts
load in about a second. Nothing here ever reaches a model hub: every from_pretrained call is
local_files_only (and the CLI defaults HF_HUB_OFFLINE to 1 when it runs a command).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.defaults import PRECISIONS, resolve_precision, specdec_home
from specdec.engine.api import ModelInfo
from specdec.runtime.allocator import keep_freed_memory, release_freed_memory
from specdec.runtime.compute_thread import ComputeThread
from specdec.runtime.file_lock import file_lock
from specdec.runtime.fixed_attention import attention_choice
from specdec.runtime.int8 import invariant_kv_dtype, quantize_linears, use_invariant_attention
from specdec.runtime.int8_kernels import CACHE_FILE as KERNEL_CACHE_FILE
from specdec.runtime.int8_kernels import choose_kernels
from specdec.runtime.layer_kernels import use_layer_kernels
from specdec.runtime.tokenizers import load_tokenizer, tokenizer_fingerprint

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Every nn.Linear replaced by a batch-invariant int8 one (specdec.runtime.int8: int8 weights per
# channel, activations per row), pass-invariant attention (specdec.runtime.fixed_attention). CPU
# only. Much faster than float32 on the 2-core dev machine; it changes the model's distribution,
# so compare against int8 too.
INT8 = "int8"
assert set(PRECISIONS) == {*DTYPES, INT8}
SOURCE_FILE = "specdec_source.json"  # written into converted directories: where they came from
_HASH_CACHE_FILE = "hashes.json"
_hash_lock = threading.Lock()


class ModelPathError(FileNotFoundError):
    """The model path is missing or holds no loadable model; the message names the path."""


@dataclass
class LoadedModel:
    """A model ready for scoring: eval mode, on its device, with tokenizer and public info."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    info: ModelInfo
    directory: Path  # the HF directory actually loaded (the converted one for GGUF)
    # The thread that loaded the model and runs its passes (specdec.runtime.compute_thread: one
    # OpenMP team per process); None: each ForwardBatcher over it starts its own.
    compute: ComputeThread | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


# ----------------------------------------------------------------------------------------------
# hashing (cached by size + mtime so a 3 GB file is hashed once)


def sha256_file(path: str | Path, chunk_size: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_cache_path(home: Path) -> Path:
    return home / _HASH_CACHE_FILE


def _read_hash_cache(home: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads(_hash_cache_path(home).read_text())
    except (OSError, ValueError):
        return {}


def remember_sha256(path: str | Path, digest: str, home: Path | None = None) -> None:
    """Record a file's sha256 against its current size + mtime (used when the hash is known)."""
    home = specdec_home(home)
    path = Path(path).resolve()
    stat = path.stat()
    with _hash_lock:
        cache = _read_hash_cache(home)
        cache[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        home.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(_hash_cache_path(home), json.dumps(cache, indent=1))


def cached_sha256(path: str | Path, home: Path | None = None) -> str:
    """sha256 of a file, re-hashing only when its size or mtime changed since last time."""
    home = specdec_home(home)
    path = Path(path).resolve()
    stat = path.stat()
    entry = _read_hash_cache(home).get(str(path))
    if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        return str(entry["sha256"])
    digest = sha256_file(path)
    remember_sha256(path, digest, home)
    return digest


def _share_permissions(directory: Path) -> None:
    """mkdtemp/mkstemp create owner-only entries; give them the umask's usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for entry in directory.rglob("*"):
        os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~umask)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------
# GGUF → safetensors, once


def _is_converted(directory: Path) -> bool:
    return (directory / SOURCE_FILE).is_file()


def _convert_into(gguf_path: Path, directory: Path, home: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except Exception as exc:  # transformers raises many kinds for unreadable files
        raise ModelPathError(f"cannot load GGUF file {gguf_path}: {exc}") from exc
    # The weights are plain tensors now; saving must not record a quantisation scheme.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    source = {
        "source": str(gguf_path.resolve()),
        "model_id": gguf_path.stem,
        "sha256": cached_sha256(gguf_path, home),
    }
    (directory / SOURCE_FILE).write_text(json.dumps(source, indent=2))
    _share_permissions(directory)


def converted_dir_for(gguf_path: str | Path, home: Path | None = None) -> Path:
    home = specdec_home(home)
    return home / "converted" / cached_sha256(gguf_path, home)[:32]


def convert_gguf(gguf_path: str | Path, home: Path | None = None, force: bool = False) -> Path:
    """Dequantise a GGUF file into a safetensors HF directory (cached by sha256) and return it.

    The directory is written under a temporary name and renamed into place, so a crash never
    leaves a half-written model behind. Weights are stored in float32: dequantised GGUF values
    (scale × small integer) are not all representable in 16-bit formats.
    """
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelPathError(f"GGUF file not found: {gguf_path}")
    home = specdec_home(home)
    target = converted_dir_for(gguf_path, home)
    if _is_converted(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter per file across processes: the others wait here, then find the result.
    with file_lock(target.parent / f".{target.name}.lock"):
        if _is_converted(target) and not force:
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed converter
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        try:
            _convert_into(gguf_path, tmp, home)
            if target.exists():  # force=True, or a directory without its source marker
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


# ----------------------------------------------------------------------------------------------
# loading


def resolve_model_dir(path: str | Path, home: Path | None = None) -> Path:
    """The HF directory to load for `path` (a directory, a .gguf file or a directory of one)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelPathError(f"model path not found: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelPathError(f"not a model directory or .gguf file: {path}")
        return convert_gguf(path, home)
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0], home)
    if len(ggufs) > 1:
        raise ModelPathError(f"{path} holds several .gguf files; name one: {[g.name for g in ggufs]}")
    raise ModelPathError(f"no config.json or .gguf file in model directory {path}")


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return tuple(ids)


def quantize_int8(model: Any, kernel_cache: Path | None = None) -> Any:
    """Replace every nn.Linear by a batch-invariant int8 one (specdec.runtime.int8; in place).

    Everything the int8 model keeps besides its int8 weights (embeddings, norms, biases) is first
    copied out of the weights file, and the replaced float modules are collected after: then no
    tensor views the memory-mapped safetensors file any more and it is unmapped. Otherwise its
    float32 pages, all read once to quantise them, stay in the process (the default target held
    8.5 GB, 6 GB of it the file, instead of 3.4 GB).

    Its Llama-family RMS norms and gated MLPs then run in C (specdec.runtime.layer_kernels).
    Then the int8 GEMM is chosen per weight shape for this CPU (specdec.runtime.int8_kernels;
    `kernel_cache`: the JSON file that keeps the measurement, None: measure every time).
    """
    import gc

    linear_weights = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Linear)}
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if id(tensor) not in linear_weights:
                tensor.data = tensor.data.clone()
        attention = attention_choice()  # once: the cache's dtype and the attention that reads it
        model = quantize_linears(model, kv_dtype=invariant_kv_dtype(attention))
        use_layer_kernels(model)
    choose_kernels(model, kernel_cache)
    use_invariant_attention(model, attention)
    gc.collect()
    return model


def load_model(
    path: str | Path,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    home: Path | None = None,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load a model for the engines. `attn_implementation` must honour custom 4D masks (sdpa, eager).

    `dtype` is one of specdec.defaults.PRECISIONS, or "auto" for the device's fast precision.
    """
    from transformers import AutoModelForCausalLM

    dtype = resolve_precision(dtype, device)
    if dtype == INT8 and torch.device(device).type != "cpu":
        raise ValueError(f"dtype int8 (dynamic quantisation) runs on the CPU only, not on {device!r}")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    directory = resolve_model_dir(path, home)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(directory),
            dtype=DTYPES.get(dtype, torch.float32),
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
    except OSError as exc:
        raise ModelPathError(f"cannot load model from {directory}: {exc}") from exc
    model.to(device)
    model.eval()
    if torch.device(device).type == "cpu":
        keep_freed_memory()  # a pass's large temporaries come back from the heap, not page faults
        # Our passes carry a mask (tree / batch layout), and with a mask transformers' sdpa copies
        # every key/value head group by group (repeat_kv) unless told that the kernel handles
        # grouped-query attention itself, which the CPU kernel does: the same logits (checked on
        # the default pair), without the copy, which grows with batch x context. Set it to 0 to
        # opt out. (On CUDA a masked GQA call would leave the fast kernel, so only here.)
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    tokenizer = load_tokenizer(directory)
    source_file = directory / SOURCE_FILE
    model_id = directory.name
    if source_file.exists():
        model_id = json.loads(source_file.read_text()).get("model_id", model_id)
    if dtype != "float32":  # another precision is another distribution (α, calibration differ)
        model_id = f"{model_id}@{dtype}"
    output = model.get_output_embeddings()
    vocab_size = int(output.weight.shape[0]) if output is not None else int(model.config.vocab_size)
    del output  # a float Linear: held here, it would keep its part of the weights file mapped
    if dtype == INT8:
        model = quantize_int8(model, specdec_home(home) / KERNEL_CACHE_FILE)
    if torch.device(device).type == "cpu":
        release_freed_memory()  # the float weights quantising freed, kept by the raised thresholds
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    info = ModelInfo(
        model_id=model_id,
        vocab_size=vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        max_context=max_context,
        eos_token_ids=_eos_ids(model, tokenizer),
        device=str(device),
        dtype=dtype,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, directory=directory)
