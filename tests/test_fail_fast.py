"""Bad input fails fast and clearly, before any stage runs: damaged weight files (cut inside their data, header
intact) in a folder, as single files and as LoRAs; zero and negative numbers; a later stage asked for another size
than its stage files were made at; misspelled or abbreviated options. Each is exit code 2 with a message that
names the input, in seconds, with no stage file written and nothing compiled."""

import shutil
import time

import pytest
from conftest import NEGATIVE, PROMPT

from tpu_runtime.engine.runtime import compile_stats
from comfy_files import export_wan_files as export_comfy_files
from tpu_runtime.families.wan.tiny import build_tiny_lora
from tpu_runtime.tools import stage_files
from tpu_runtime.tools.cli import main

STAGE_FILES = (stage_files.EMBEDDINGS_FILE, stage_files.LATENTS_FILE, stage_files.FRAMES_FILE,
               stage_files.VIDEO_FILE)


def cut(path, keep: float = 0.6):
    """A download interrupted inside the data: the header is whole, the last tensors' bytes are missing."""
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    path.write_bytes(data[:header + int((len(data) - header) * keep)])
    return path


def _refused(args, out, capsys, *needles):
    from tpu_runtime.engine.runtime import get_runtime

    get_runtime()  # its own start-up (torchax's random key) is not a stage's compile
    before = compile_stats()
    start = time.monotonic()
    code = main(args + ["--output-dir", str(out)])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    for needle in needles:
        assert needle in err, err
    assert seconds < 30, seconds
    assert compile_stats().since(before).backend_compiles == 0
    assert not any((out / name).exists() for name in STAGE_FILES)
    return err


@pytest.mark.parametrize("component", ["transformer", "text_encoder", "vae"])
def test_a_cut_file_in_a_folder_is_refused_at_open(tiny_wan, tmp_path, capsys, component):
    folder = tmp_path / "model"
    shutil.copytree(tiny_wan["2.1"], folder)
    damaged = next((folder / component).glob("*.safetensors"))
    cut(damaged)
    err = _refused(["generate", "--model", str(folder), "--prompt", PROMPT], tmp_path / "out", capsys,
                   f"{component} file {damaged} is cut short", "(an interrupted download?): re-download it")
    assert "Traceback" not in err


@pytest.mark.parametrize("role, flag", [("transformer", "--transformer"), ("text_encoder", "--text-encoder"),
                                        ("vae", "--vae")])
def test_a_cut_single_file_is_refused_at_open(tiny_wan, tmp_path, capsys, role, flag):
    files = export_comfy_files(tiny_wan["2.1"], tmp_path / "files", "fp16")
    cut(files[role])
    args = ["generate", "--prompt", PROMPT, "--transformer", str(files["transformer"]), "--text-encoder",
            str(files["text_encoder"]), "--vae", str(files["vae"])]
    _refused(args, tmp_path / "out", capsys, f"{files[role]} is cut short", "re-download it")


def test_a_cut_lora_is_refused_before_any_stage(tiny_wan, tmp_path, capsys):
    lora = cut(build_tiny_lora(tiny_wan["2.1"] / "transformer", tmp_path / "style.safetensors", "comfy"))
    _refused(["generate", "--model", str(tiny_wan["2.1"]), "--prompt", PROMPT, "--lora", f"{lora}:0.8"],
             tmp_path / "out", capsys, f"LoRA file {lora} is cut short", "re-download it")


def test_a_cut_stage_file_is_refused_before_the_next_stage_runs(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["generate", "--model", str(tiny_models["2b"]), "--prompt", PROMPT, "--height", "64", "--width",
                 "96", "--frames", "9", "--steps", "2", "--stage", "encode", "--output-dir", str(out)]) == 0
    cut(out / stage_files.EMBEDDINGS_FILE, keep=0.5)
    capsys.readouterr()
    code = main(["generate", "--model", str(tiny_models["2b"]), "--stage", "sample", "--output-dir", str(out)])
    assert code == 2
    assert "is not a readable text-embedding file: it is cut short" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, message", [
    ("--frames", "0", "--frames 0 must be a whole number at least 1"),
    ("--height", "0", "--height 0 must be a whole number at least 1"),
    ("--width", "-16", "--width -16 must be a whole number at least 1"),
    ("--fps", "0", "--fps 0 must be a whole number at least 1"),
    ("--fps", "-4", "--fps -4 must be a whole number at least 1"),
    ("--steps", "0", "--steps 0 must be a whole number at least 1"),
    ("--steps", "-3", "--steps -3 must be a whole number at least 1"),
    ("--guidance", "-1", "--guidance -1.0 must be a number at least 0.0"),
    ("--seed", "-1", "--seed -1 must be a whole number at least 0"),
    ("--shift", "0", "--shift 0.0 must be a number above 0.0"),
    ("--boundary", "1.5", "--boundary 1.5 must be a number above 0.0 and below 1.0"),
])
def test_zero_and_negative_numbers_are_refused_not_replaced(tiny_wan, tmp_path, capsys, option, value, message):
    _refused(["generate", "--model", str(tiny_wan["2.1"]), "--prompt", PROMPT, option, value], tmp_path / "out",
             capsys, message)


def test_the_sampler_node_refuses_what_the_cli_refuses(tiny_models):
    """The same rules hold in the nodes (one place: the family's settings check)."""
    from tpu_runtime.engine.stages import SampleSettings
    from tpu_runtime.errors import InputError
    from tpu_runtime.families.cogvideox.model import CogVideoXFamily

    family = CogVideoXFamily(tiny_models["2b"], dtype="float32")
    embeddings = family.encode(PROMPT)
    before = compile_stats()
    for settings, message in ((SampleSettings(64, 96, 9, steps=0), "steps=0 must be a whole number at least 1"),
                              (SampleSettings(64, 96, 9, guidance=-2.0), "guidance=-2.0 must be a number at least"),
                              (SampleSettings(64, 96, 9, seed=-5), "seed=-5 must be a whole number at least 0"),
                              (SampleSettings(0, 96, 9), "height=0 must be a positive multiple of 16")):
        with pytest.raises(InputError, match=message):
            family.sample(embeddings, settings)
    assert compile_stats().since(before).backend_compiles == 0


def test_a_later_stage_takes_the_size_its_stage_files_were_made_at(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    model = str(tiny_models["2b"])
    assert main(["generate", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--height", "64",
                 "--width", "96", "--frames", "9", "--steps", "2", "--stage", "encode", "--output-dir", str(out)]) == 0
    # No size given: the encoded size, not the model's native 480x720x49.
    assert main(["generate", "--model", model, "--steps", "2", "--stage", "sample", "--output-dir", str(out)]) == 0
    latents = stage_files.load_latents(out)
    assert (latents.height, latents.width, latents.num_frames) == (64, 96, 9)
    capsys.readouterr()
    assert main(["generate", "--model", model, "--steps", "2", "--stage", "sample", "--frames", "17",
                 "--output-dir", str(out)]) == 2
    assert "--frames 17 differs from the 9 stage 1 was encoded for" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["generate", "--cache-d", "xla"], "unrecognized arguments: --cache-d xla"),  # not --cache-dir
    (["generate", "--stag", "all"], "unrecognized arguments: --stag"),
    (["plan", "--top", "v6e-8"], "the following arguments are required: --topology"),
])
def test_options_are_exact(args, needle, capsys):
    """No abbreviations: a misspelled or future option is an error, never taken for another one."""
    with pytest.raises(SystemExit) as exit_:
        main(args + ["--output-dir", "unused"] if args[0] == "generate" else args)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_every_option_of_every_command_has_help():
    import argparse

    from tpu_runtime.tools.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {"generate", "demo", "bench", "plan", "worker", "cache"}
    for name, parser in commands.items():
        assert parser.allow_abbrev is False, name
        bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
        assert bare == [], (name, bare)


def test_plan_help_lists_every_known_model(capsys):
    from tpu_runtime.families import registry

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert len(registry.known_models()) >= 13
    for name in registry.known_models():
        assert name in text
