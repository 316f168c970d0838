"""Every file tinykv writes, in one place. Before the slow part, `check_outputs` refuses an output
that is an input of the run or another output, a folder, a device or a pipe, read-only, or in a
folder that is missing or not writable. Then `written(path)` gives a temporary name beside the
output (its suffix kept, so a format read from the name is the output's) and renames it over
the output only once the block that writes it has finished: a failed or interrupted run leaves
the old file as it was, and nothing of its own behind. Plain Python, no torch: the command line
checks its outputs before it imports anything heavy. An output the user did not name (a chart
beside --out) replaces only a file tinykv wrote."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

# what the user calls a file (a flag, '--out chart') -> its path; None: not asked for
Paths = Mapping[str, "str | Path | None"]
# A PNG text entry every chart tinykv writes carries: a chart beside --out that lacks it is
# someone else's file, never replaced.
CHART_MARK = ("Source", "tinykv")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class OutputError(ValueError):
    """An output that must not or cannot be written; one line, before anything is computed."""


def check_outputs(outputs: Paths, inputs: Paths | None = None,
                  make_folders: bool = False, derived: Paths | None = None) -> None:
    """Refuse, naming it, an output that is not a file tinykv may replace (check_output), that is
    the same file as another output or as an input, or that would replace a file inside an input
    folder (a model folder: a new file beside its own is fine). `derived` are outputs whose names
    the user did not give (a chart beside --out): one that exists is replaced only where tinykv
    wrote it (made_by_tinykv). With make_folders, an output's missing folders are made when it
    is written."""
    finals: dict[Path, str] = {}
    everything = [(name, path, False) for name, path in outputs.items()]
    everything += [(name, path, True) for name, path in (derived or {}).items()]
    for name, path, is_derived in everything:
        if path is None:
            continue
        final = check_output(name, path, make_folders)
        if is_derived and final.exists() and not made_by_tinykv(final):
            raise OutputError(f"{name} {path} exists and is not one tinykv wrote: move it, or "
                              "give --out another name")
        if final in finals:
            raise OutputError(f"{name} {path} is also {finals[final]}: one output would "
                              "overwrite the other")
        finals[final] = f"{name}"
        for in_name, in_path in (inputs or {}).items():
            if in_path is not None:
                check_not_input(name, path, final, in_name, Path(in_path))


def png_texts(path: Path) -> dict[str, str]:
    """The tEXt entries of a PNG file (none where it is not one): those before its image data,
    where matplotlib writes its metadata."""
    with open(path, "rb") as f:
        data = f.read(1 << 16)
    if not data.startswith(PNG_SIGNATURE):
        return {}
    texts, at = {}, len(PNG_SIGNATURE)
    while at + 8 <= len(data):
        length, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        if kind == b"IDAT":
            break
        if kind == b"tEXt":
            key, _, value = data[at + 8:at + 8 + length].partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + length  # length, kind, data, CRC
    return texts


def made_by_tinykv(path: Path) -> bool:
    """Whether an existing file is one tinykv wrote: a PNG chart carries CHART_MARK
    (plots.save_figure); a JSON is a benchmark's results (its machine record) or a vLLM
    kv_cache_scheme entry."""
    if path.suffix.lower() == ".png":
        key, value = CHART_MARK
        return png_texts(path).get(key) == value
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and ("machine" in data or list(data) == ["kv_cache_scheme"])
    return False


def check_output(name: str, path: str | Path, make_folders: bool = False) -> Path:
    """Where output `path` lands (symlinks followed: renaming over a link would replace the
    link), refused unless it is a regular file or nothing yet, writable, in a writable folder."""
    if str(path) in ("", "-"):
        raise OutputError(f"{name} {str(path)!r}: give a file name (tinykv does not write to "
                          "stdout)")
    final = Path(path).resolve()
    if final.exists():
        mode = final.stat().st_mode
        if stat.S_ISDIR(mode):
            raise OutputError(f"{name} {path} is a folder; give a file name")
        if not stat.S_ISREG(mode):
            raise OutputError(f"{name} {path} is not a regular file (a device or a pipe): tinykv "
                              "writes a file whole, then renames it into place")
        if not mode & 0o222 or not os.access(final, os.W_OK):  # root may, but it was protected
            raise OutputError(f"{name} {path} is read-only")
    there = nearest_existing(final.parent)
    if not there.is_dir():
        raise OutputError(f"{name} {path}: {there} is a file, not a folder")
    if there != final.parent and not make_folders:
        raise OutputError(f"{name} {path}: folder {final.parent} does not exist")
    if not os.access(there, os.W_OK | os.X_OK):
        raise OutputError(f"{name} {path}: folder {there} is not writable")
    return final


def check_not_input(name: str, path: str | Path, final: Path, in_name: str,
                    in_path: Path) -> None:
    """Output `final` is not input `in_path`, nor an existing file inside an input folder."""
    if in_path.is_dir():
        inside = final.exists() and final.is_relative_to(in_path.resolve())
        if inside:
            raise OutputError(f"{name} {path} would replace a file of the {in_name} folder "
                              f"{in_path}; write it elsewhere")
        return
    try:
        same = os.path.samefile(final, in_path)  # hard links and symlinks too
    except OSError:  # one of them does not exist yet
        same = final == in_path.resolve()
    if same:
        raise OutputError(f"{name} {path} is the input {in_name} {in_path}: tinykv does not "
                          "overwrite its inputs")


def nearest_existing(path: Path) -> Path:
    """path, or the nearest of its parents that exists."""
    return next(d for d in (path, *path.parents) if d.exists())


@contextmanager
def written(path: str | Path, make_folders: bool = False) -> Iterator[Path]:
    """A temporary file beside `path` to write the output to: renamed over `path` when the block
    ends, deleted (with the folders make_folders made) when it raises, Ctrl-C included. The
    output keeps the mode of the file it replaces, or gets a new file's."""
    final = Path(path).resolve()
    made = [d for d in (final.parent, *final.parent.parents) if not d.exists()]
    if made and not make_folders:
        raise OutputError(f"{path}: folder {final.parent} does not exist")
    final.parent.mkdir(parents=True, exist_ok=True)
    # '.NAME-XXXXXXXX.SUFFIX': hidden, and the suffix is the output's (or none, as it has none)
    fd, name = tempfile.mkstemp(prefix=f".{final.stem}-", suffix=final.suffix, dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, stat.S_IMODE(final.stat().st_mode) if final.exists() else new_file_mode())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        remove_empty(made)
        raise


def new_file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def remove_empty(folders: list[Path]) -> None:
    """Remove these folders, innermost first, stopping at the first that is not empty."""
    for d in folders:
        try:
            d.rmdir()
        except OSError:
            return


def write_text(path: str | Path, text: str, make_folders: bool = False) -> None:
    """`path` holds `text` (UTF-8), written whole (`written`)."""
    with written(path, make_folders) as tmp:
        tmp.write_text(text, encoding="utf-8")
