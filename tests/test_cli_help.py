"""Every `megatron-rl` subcommand and argument explains itself in --help."""
from __future__ import annotations

import argparse

import pytest

from megatron_rl.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    return [a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]


def test_every_subcommand_has_a_help_line():
    sub = _subparsers(build_parser())
    helped = {a.dest: a.help for a in sub._choices_actions}
    assert set(helped) == set(sub.choices) == {"train", "sft", "serve", "engines", "data", "convert", "config", "study", "plan",
                                                                                                  "hp-measure"}
    assert all((h or "").strip() for h in helped.values()), helped


@pytest.mark.parametrize("command", ["train", "sft", "engines", "data", "convert", "config", "study", "plan", "hp-measure"])
def test_every_argument_has_a_help_line(command):
    assert not _undocumented(_subparsers(build_parser()).choices[command])


def test_serve_arguments_have_help_lines():
    from megatron_rl.engine.server import build_arg_parser

    assert not _undocumented(build_arg_parser())


def test_convert_help_explains_its_arguments(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "--help"])
    out = capsys.readouterr().out
    for fragment in ("HF directory, or megatron checkpoint", "output directory", "*-to-fp8: blockwise FP8", "--scale-fmt",
                     "megatron-to-hf: safetensors shards"):
        assert fragment in out
