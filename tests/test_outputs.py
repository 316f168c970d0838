"""tinykv.outputs: what may be written is checked first; a write lands whole or not at all."""

import os
import stat
from pathlib import Path

import pytest

from tinykv.outputs import OutputError, check_outputs, write_text, written


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_refuses_an_input_another_output_a_folder_or_a_device(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("my text")
    (tmp_path / "link.txt").symlink_to(text)
    os.link(text, tmp_path / "hard.txt")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    inputs = {"--text": text, "--weights": model}
    cases = [({"--out": text}, "is the input --text"),
             ({"--out": tmp_path / "link.txt"}, "is the input --text"),  # a symlink to it
             ({"--out": tmp_path / "hard.txt"}, "is the input --text"),  # a hard link to it
             ({"--out": tmp_path / "sub" / ".." / "text.txt"}, "is the input --text"),
             ({"--out": model / "config.json"}, "a file of the --weights folder"),
             ({"--out": tmp_path / "a.bin", "--vllm-out": tmp_path / "a.bin"}, "is also --out"),
             ({"--out": tmp_path}, "is a folder"),
             ({"--out": "/dev/null"}, "not a regular file"),
             ({"--out": "-"}, "give a file name"),
             ({"--out": tmp_path / "missing" / "a.bin"}, "does not exist"),
             ({"--out": text / "a.bin"}, "is a file, not a folder")]
    (tmp_path / "sub").mkdir()
    for outputs, why in cases:
        with pytest.raises(OutputError, match=why):
            check_outputs(outputs, inputs)
    assert text.read_text() == "my text"
    # a new file beside the model's own is fine, and so is a missing folder made on request
    check_outputs({"--out": model / "scales.safetensors"}, inputs)
    check_outputs({"--out": tmp_path / "new" / "a.json"}, inputs, make_folders=True)


def test_refuses_a_read_only_output_or_folder(tmp_path):
    old = tmp_path / "old.json"
    old.write_text("{}")
    old.chmod(0o444)
    with pytest.raises(OutputError, match="read-only"):  # even for root: it was protected
        check_outputs({"--out": old})
    if os.geteuid() == 0:
        return  # root may write into any folder
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    with pytest.raises(OutputError, match="not writable"):
        check_outputs({"--out": locked / "a.json"})


@pytest.mark.parametrize("failure", [ValueError, KeyboardInterrupt])
def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path, failure):
    out = tmp_path / "scales.safetensors"
    out.write_text("old")
    with pytest.raises(failure):
        with written(out) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".safetensors"
            tmp.write_text("half")
            raise failure()
    assert names(tmp_path) == ["scales.safetensors"] and out.read_text() == "old"


def test_a_write_replaces_whole_and_keeps_the_mode(tmp_path):
    out = tmp_path / "chart.png"
    out.write_text("old")
    out.chmod(0o640)
    write_text(out, "new")
    assert out.read_text() == "new" and stat.S_IMODE(out.stat().st_mode) == 0o640
    assert names(tmp_path) == ["chart.png"]
    # through a symlink: the file it points to is replaced, the link stays a link
    (tmp_path / "link.png").symlink_to(out)
    write_text(tmp_path / "link.png", "newer")
    assert (tmp_path / "link.png").is_symlink() and out.read_text() == "newer"


def test_made_folders_go_when_the_write_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with written(tmp_path / "a" / "b" / "out.json", make_folders=True) as tmp:
            tmp.write_text("{}")
            raise RuntimeError
    assert names(tmp_path) == []
    write_text(tmp_path / "a" / "b" / "out.json", "{}", make_folders=True)
    assert (tmp_path / "a" / "b" / "out.json").read_text() == "{}"
    with pytest.raises(OutputError, match="does not exist"):
        write_text(tmp_path / "c" / "out.json", "{}")


def test_an_output_the_user_did_not_name_replaces_only_a_file_tinykv_wrote(tmp_path):
    """A chart beside --out, or a JSON the command names itself, that exists: replaced where
    tinykv wrote it (its charts carry a PNG text mark, its results a machine record), refused
    and left as it was otherwise; the same names given on the command line are the user's
    choice and replaced."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tinykv.plots import save_figure

    mine = tmp_path / "mine.png"
    fig = plt.figure()
    plt.plot([0, 1])
    save_figure(fig, mine)
    theirs = tmp_path / "theirs.png"
    fig = plt.figure()
    plt.plot([0, 1])
    fig.savefig(theirs)  # matplotlib's own metadata, not tinykv's mark
    plt.close(fig)
    before = theirs.read_bytes()
    check_outputs({}, derived={"the chart": mine})
    with pytest.raises(OutputError, match="exists and is not one tinykv wrote"):
        check_outputs({}, derived={"the chart": theirs})
    assert theirs.read_bytes() == before
    check_outputs({"--plot": theirs})  # named by the user: theirs to replace
    results, notes = tmp_path / "results.json", tmp_path / "notes.json"
    results.write_text(json.dumps({"machine": {"cpu": "x"}, "rows": []}))
    notes.write_text(json.dumps({"todo": ["keep me"]}))
    check_outputs({}, derived={"the JSON": results})
    with pytest.raises(OutputError, match="the JSON"):
        check_outputs({}, derived={"the JSON": notes})
    not_png = tmp_path / "fake.png"
    not_png.write_text("a text file named .png")
    with pytest.raises(OutputError, match="fake.png"):
        check_outputs({}, derived={"the chart": not_png})
    check_outputs({}, derived={"the chart": tmp_path / "new.png"})  # nothing there yet
