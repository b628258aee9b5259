"""outputs.py: a command never replaces what a user did not ask to lose, and never leaves half an output (issue 42).

The commands' one-line refusals are rows of test_cli_errors.py; here, the rules and the writes themselves."""

from __future__ import annotations

import pytest

from ntl_pretrain.errors import InputError
from ntl_pretrain.outputs import IMAGE_METADATA, SIGNATURE, check_output, starts_with, write_file, write_folder


def test_an_input_a_symlink_or_an_existing_file_is_refused_and_overwrite_lifts_only_the_last_two(tmp_path):
    recipe, model = tmp_path / "recipe.yaml", tmp_path / "model"
    recipe.write_text("seed: 1\n")
    model.mkdir()
    (tmp_path / "link.png").symlink_to(recipe)
    for overwrite in (False, True):
        with pytest.raises(InputError, match="is \\(or holds\\) the input"):
            check_output("-o", recipe, [recipe], overwrite)
        with pytest.raises(InputError, match="is \\(or holds\\) the input"):  # a folder holding an input
            check_output("out_dir", tmp_path, [model / "config.json"], overwrite, folder=True)
    with pytest.raises(InputError, match="link.png is a symlink to .*recipe.yaml; .*--overwrite"):
        check_output("-o", tmp_path / "link.png")
    with pytest.raises(InputError, match="recipe.yaml exists \\(file\\).*--overwrite"):
        check_output("-o", recipe)
    check_output("-o", tmp_path / "link.png", overwrite=True)
    check_output("-o", recipe, overwrite=True)
    check_output("out_dir", model, folder=True)  # an empty folder holds nothing to lose
    check_output("--out", model / "eval.json", [model])  # a new file inside an input folder is fine


def test_a_command_may_replace_its_own_earlier_output(tmp_path):
    ours, theirs = tmp_path / "ours.png", tmp_path / "theirs.png"
    write_file(ours, lambda partial: partial.write_bytes(b"\x89PNG\r\n\x1a\n tEXtSoftware\x00" + SIGNATURE.encode()))
    theirs.write_bytes(b"\x89PNG\r\n\x1a\n a photo")
    signed = starts_with(SIGNATURE.encode())
    check_output("-o", ours, ours=signed)
    with pytest.raises(InputError, match="exists"):
        check_output("-o", theirs, ours=signed)


def test_plot_images_carry_the_signature(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure()
    path = write_file(
        tmp_path / "a.png", lambda partial: figure.savefig(partial, format="png", metadata=IMAGE_METADATA)
    )
    plt.close(figure)
    assert starts_with(SIGNATURE.encode())(path)


def test_writing_through_a_symlink_replaces_the_link_and_never_its_target(tmp_path):
    target = tmp_path / "recipe.yaml"
    target.write_text("seed: 1\n")
    (tmp_path / "out.png").symlink_to(target)
    write_file(tmp_path / "out.png", lambda partial: partial.write_bytes(b"image"))
    assert target.read_text() == "seed: 1\n"
    assert not (tmp_path / "out.png").is_symlink() and (tmp_path / "out.png").read_bytes() == b"image"


def test_an_interrupted_write_leaves_the_old_output_or_none_and_no_partial(tmp_path):
    def config_then_killed(folder):
        (folder / "config.json").write_text("{}")  # an HF-looking folder, weights not written yet
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_folder(tmp_path / "export", config_then_killed)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no `export`, no `.export.partial-*`

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors").write_bytes(b"old weights")
    with pytest.raises(KeyboardInterrupt):
        write_folder(tmp_path / "export", config_then_killed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == b"old weights"

    with pytest.raises(KeyboardInterrupt):
        write_file(
            tmp_path / "eval.json", lambda partial: (partial.write_text("{"), (_ for _ in ()).throw(KeyboardInterrupt))
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_finished_folder_write_replaces_the_old_folder_whole(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "stale.bin").write_bytes(b"old")
    write_folder(tmp_path / "export", lambda folder: (folder / "model.safetensors").write_bytes(b"new"))
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
