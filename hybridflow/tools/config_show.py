"""``hybridflow config show --config F [key=value ...]``: every resolved value and where it came from
(the schema's default, a file, or an override); ``hybridflow config dump``: the schema's defaults as YAML."""

from __future__ import annotations

import argparse
import sys

import yaml

from hybridflow.config import ConfigError, config_to_dict
from hybridflow.config.schema import ExperimentConfig
from hybridflow.config.show import render
from hybridflow.plan import load_experiment
from hybridflow.trainer.main import dry_run


def show(paths: list[str], overrides: list[str]) -> str:
    sources: dict[str, str] = {}
    return render(load_experiment(paths, overrides, sources=sources), sources)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hybridflow config", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p_show = sub.add_parser("show", help="resolved config with the source of every value")
    p_show.add_argument("--config", action="append", required=True, help="YAML file(s); later ones override")
    p_show.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p_show.add_argument("--verl-overrides", nargs=argparse.REMAINDER, metavar="VERL_ARG",
                        help="last: a verl command line's arguments, unchanged")
    sub.add_parser("dump", help="the schema's defaults as YAML")
    args = ap.parse_args(argv)
    try:
        if args.command == "dump":
            print(yaml.safe_dump(config_to_dict(ExperimentConfig()), sort_keys=False), end="")
        elif args.verl_overrides is not None:  # a verl command line too: the trainer's dry run
            configs = [arg for path in args.config for arg in ("--config", path)]
            print(dry_run([*configs, *args.overrides, "--verl-overrides", *args.verl_overrides]))
        else:
            print(show(args.config, args.overrides))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
