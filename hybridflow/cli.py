"""The ``hybridflow`` console script: one command per task, each parsed by its own module (``hybridflow
COMMAND --help``). A command line without a command is ``train``'s (``hybridflow --config F ...``)."""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module whose main(argv) runs it, one line of help)
COMMANDS = {
    "train": ("hybridflow.trainer.main", "train a PPO-family run from YAML configs (and a verl command line)"),
    "sft": ("hybridflow.trainer.sft", "supervised fine-tuning (the warm start) on parquet prompt/response pairs"),
    "export": ("hybridflow.tools.export", "a checkpoint's actor as a Hugging Face model folder"),
    "check-model": ("hybridflow.tools.check_model", "convert a HF model to megatron and vLLM at a layout, compare"),
    "config": ("hybridflow.tools.config_show", "show a resolved config with each value's source, or dump defaults"),
}


def parser() -> argparse.ArgumentParser:
    """The command list (``hybridflow --help``); each command's own parser reads the rest of its line."""
    ap = argparse.ArgumentParser(prog="hybridflow", description="RL post-training of LLMs on megatron-core, vLLM "
                                 "and Ray.", epilog="hybridflow COMMAND --help: that command's options")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser().print_help()
        return 0 if argv else 2
    command, rest = (argv[0], argv[1:]) if argv[0] in COMMANDS else ("train", argv)
    return importlib.import_module(COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
