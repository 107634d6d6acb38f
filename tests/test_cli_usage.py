"""What a user sees for a flag the command does not take, and the help's account of the timing: an unknown
argument is reported by the subcommand's own parser (its usage, not the top-level one), naming the other commands
that take that flag; `bench --help` and `run --help` say the times come from interleaved rounds."""

import pytest

from cp_ops.cli.main import build_parser, main


def _error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_flag_of_another_command_names_that_command(capsys):
    lines = _error(capsys, ["run", "wan", "--plot", "x.png"])
    assert lines[0].startswith("usage: cp-ops run ")  # run's usage, where its options are listed
    assert lines[-1] == ("cp-ops run: error: unrecognized arguments: --plot x.png "
                         "(--plot is an option of cp-ops bench)"), lines
    lines = _error(capsys, ["bench", "--steps=3", "--compile", "--foo"])
    assert lines[0].startswith("usage: cp-ops bench ")
    assert lines[-1] == ("cp-ops bench: error: unrecognized arguments: --steps=3 --compile --foo (--steps is an option "
                         "of cp-ops run, cp-ops bound, cp-ops generate; --compile is an option of cp-ops run, "
                         "cp-ops plan)"), lines


def test_unknown_flag_and_stray_word(capsys):
    lines = _error(capsys, ["bench", "--foo"])
    assert lines[0].startswith("usage: cp-ops bench ")
    assert lines[-1] == "cp-ops bench: error: unrecognized arguments: --foo"
    lines = _error(capsys, ["run", "wan", "extra"])
    assert lines[0].startswith("usage: cp-ops run ") and lines[-1] == "cp-ops run: error: unrecognized arguments: extra"


def test_bad_value_still_argparse_error(capsys):
    lines = _error(capsys, ["run", "wan", "--chunks", "0"])
    assert lines[-1] == "cp-ops run: error: argument --chunks: expected auto or an int >= 1; got '0'"


def test_help_describes_the_interleaved_rounds():
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name in ("bench", "run"):
        text = " ".join(sub[name].format_help().split())
        assert "interleaved rounds" in text, name
    assert "each times the single-device baseline, then one sample of every case" in " ".join(
        sub["bench"].format_help().split())


def test_generate_without_checkpoint_says_what_runs_without_one(capsys):
    """`cp-ops generate` alone: argparse's 'required: --checkpoint' plus where a user without a pipeline folder goes
    (the tiny CPU example); other missing arguments keep argparse's plain message."""
    lines = _error(capsys, ["generate"])
    assert lines[-1] == ("cp-ops generate: error: the following arguments are required: --checkpoint (no pipeline "
                         "folder at hand: torchrun --nproc-per-node 2 -m cp_ops.examples.generate runs a tiny random "
                         "one on the CPU)"), lines
    lines = _error(capsys, ["generate", "--checkpoint", "x"])
    assert lines[-1] == "cp-ops generate: error: one of the arguments --prompt --prompt-embeds is required", lines


def test_run_help_points_to_bound_for_every_moved_flag():
    """The bound's flags are `cp-ops bound`'s: `run --help` names each one that `run` turns away, and the command."""
    from cp_ops.cli.bound_args import MOVED

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    text = " ".join(sub["run"].format_help().replace("-\n", "-").split())
    assert "cp-ops bound MODEL --worlds" in text, text
    for flag in MOVED:
        if flag != "--bound-compile":  # the old spelling of --compile-modes, a flag run never had on its own
            assert flag in text, flag


def test_plan_without_diffusers_says_what_to_install(monkeypatch, capsys):
    """`cp-ops plan MODEL --gpus N` on the README's install (no diffusers): the one-line install hint that `run` gives,
    exit code 2, not a ModuleNotFoundError traceback."""
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real(name, *a))
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises, as where it is not installed
    assert main(["plan", "wan", "--gpus", "8"]) == 2
    out = capsys.readouterr()
    assert "cp-ops: plan wan needs diffusers: pip install -e '.[diffusers]'" in out.out + out.err, out


@pytest.mark.skipif(__import__("importlib").util.find_spec("diffusers") is None, reason="needs diffusers")
def test_plan_without_transformers_refuses_instead_of_planning_no_cfg(monkeypatch, capsys):
    """diffusers without transformers exports its pipelines as placeholders whose `__call__` has no defaults: the plan
    read 'CFG: off by default' for Wan and Qwen-Image and printed CP8 instead of 2 lanes x CP4. It says what to
    install instead."""
    import diffusers
    from diffusers.utils import DummyObject

    class WanPipeline(metaclass=DummyObject):  # what `diffusers.WanPipeline` is where transformers is missing
        _backends = ["torch", "transformers"]

    monkeypatch.setattr(diffusers, "WanPipeline", WanPipeline)
    assert main(["plan", "wan", "--gpus", "8"]) == 2
    out = capsys.readouterr()
    assert "cp-ops: plan wan needs transformers" in out.out + out.err, out
    assert "planned layout" not in out.out, out.out


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformers") is None, reason="needs transformers")
def test_plan_with_cfg_on_odd_n_is_a_usage_error(capsys):
    """`plan --gpus 7 --cfg` asks for a layout parallelize refuses (two equal lanes need an even N): exit code 2 and
    the rule with the value, not a printed 'planned layout' and exit code 0."""
    assert main(["plan", "wan", "--gpus", "7", "--cfg"]) == 2
    out = capsys.readouterr()
    assert "cp-ops: plan wan: --cfg needs an even --gpus; got 7" in out.out + out.err, out
    assert "planned layout" not in out.out, out.out


def test_run_plan_points_to_the_plan_command(capsys):
    """`--plan` was a flag of `run` that ran nothing; `cp-ops run wan --plan 8` names the command that prints the plan
    now, with the model filled in."""
    for argv, n in ((["run", "wan", "--plan", "8"], "N"), (["run", "flux", "--cfg", "--plan=4"], "N"),
                    (["run", "wan", "--plan"], "N")):
        lines = _error(capsys, argv)
        assert lines[0].startswith("usage: cp-ops run "), lines
        assert lines[-1] == (f"cp-ops run: error: --plan: the plan is its own command now: cp-ops plan {argv[1]} "
                             f"--gpus {n} (cp-ops plan --help)"), lines
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    assert "--plan" not in sub["run"]._option_string_actions
    assert "cp-ops plan MODEL --gpus N" in " ".join(sub["run"].format_help().split())


def test_plan_help_says_what_it_prints_and_takes_the_planners_flags():
    """`cp-ops plan --help`: what it prints and where the numbers come from; it takes the flags the planner reads
    (no --dtype, --chunks, --text-tokens, --device), with the GPU defaults it uses on any machine (no CPU ones)."""
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    text = " ".join(sub["plan"].format_help().split())
    for words in ("Runs nothing and needs no GPU", "zero-communication bound measured on one H200", "cp_ops/cost.py",
                  "needs transformers", "docs/pipelines.md"):
        assert words in text, words
    assert "CPU" not in text, text
    flags = {f for a in sub["plan"]._actions for f in a.option_strings} - {"-h", "--help"}
    assert flags == {"--gpus", "--cfg", "--compile", "--config", "--checkpoint", "--layers", "--frames", "--height",
                     "--width", "--batch", "--mode"}, flags


def test_run_takes_only_run_flags_and_share_device_is_a_device(capsys):
    """`run --help` lists at most 27 flags: what runs nothing (the plan) and the shared GPU (a --device value, as for
    bench) are not flags of their own. The old `--share-device` names its new spelling."""
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    flags = [a for a in sub["run"]._actions if a.option_strings and "-h" not in a.option_strings]
    assert len(flags) <= 27, [a.option_strings for a in flags]
    for cmd, argv in (("bench", ["bench"]), ("run", ["run", "wan"])):
        assert "shared" in sub[cmd]._option_string_actions["--device"].choices, cmd
        assert "--share-device" not in sub[cmd]._option_string_actions, cmd
        lines = _error(capsys, argv + ["--share-device", "--nproc", "2"])
        assert lines[0].startswith(f"usage: cp-ops {cmd} "), lines
        assert lines[-1] == f"cp-ops {cmd}: error: --share-device is --device shared now (every rank on cuda:0)", lines
