"""Entry point: ``python -m hybridflow.trainer.main --config configs/quickstart_cpu.yaml key.sub=value ...``.

The config is loaded and checked before Ray or any worker starts, so a bad key fails in a second.
"""

from __future__ import annotations

import argparse
import errno
import sys

from hybridflow import device
from hybridflow.config import ConfigError
from hybridflow.config.schema import ExperimentConfig
from hybridflow.config.show import render
from hybridflow.config.verl import check_agreement, split_argv, translate
from hybridflow.plan import load_experiment
from hybridflow.trainer import preflight
from hybridflow.trainer.signals import EXIT_PREEMPTED, Preempted, set_aside_metrics
from hybridflow.versions import check_stack

# Writes that fail for want of room or permission on the run's disk: a one-line error, not a traceback.
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def parse_args(argv=None):
    """Our arguments; everything after ``--verl-overrides`` is a verl command line's (``args.verl``)."""
    ours, verl_args = split_argv(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(prog="hybridflow", description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", required=True, help="YAML file(s); later ones override")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument("--dry-run", action="store_true",
                    help="resolve and check the config, print every value and its source, and stop")
    ap.add_argument("--verl-overrides", nargs=argparse.REMAINDER, metavar="VERL_ARG",
                    help="last: a verl command line's arguments (actor_rollout_ref.*, data.*, --config-name=..., "
                         "...), unchanged")
    args = parse_intermixed(ap, ours)
    args.verl = verl_args
    return args


def parse_intermixed(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``ap.parse_args`` that takes ``key=value`` overrides anywhere, also after a flag such as ``--dry-run``:
    argparse fills a ``nargs="*"`` positional from its first run of positionals only and calls later ones
    unrecognized (parse_intermixed_args would fix that but refuses the REMAINDER argument). Overrides keep
    their command-line order."""
    args, extra = ap.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    return args


def load(argv=None, sources: dict | None = None, no_effect: dict | None = None,
         notices: list | None = None) -> ExperimentConfig:
    """The config of a command line; ``sources``, ``no_effect`` and ``notices`` (when given) receive where each
    value came from, the verl keys accepted without effect (with the reason) and the verl settings that run
    otherwise here (``Translation.notices``)."""
    args = parse_args(argv)
    verl = translate(args.verl)
    cfg = load_experiment(args.config, [*args.overrides, *verl.overrides], sources=sources)
    check_agreement(cfg, verl.agree)
    if no_effect is not None:
        no_effect.update(verl.no_effect)
    if notices is not None:
        notices.extend(verl.notices)
    return cfg


def dry_run(argv) -> str:
    """The resolved config with the source of every value, then the verl keys that change nothing here."""
    sources, no_effect, notices = {}, {}, []
    cfg = load(argv, sources, no_effect, notices)
    preflight.check_config(cfg)
    lines = [render(cfg, sources)]
    lines += [f"# accepted without effect: {key} ({why})" for key, why in no_effect.items()]
    lines += [f"# notice: {line}" for line in notices]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Exit status: 0 done; 2 bad input (one line, nothing started); 75 preempted (SIGTERM/SIGUSR1, a
    checkpoint was written: rerun to resume); 1 the run failed (a worker died, a non-finite loss: the
    message names it and the last good checkpoint); 128+N killed by signal N (SIGINT: 130)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C where Python's default handler was still (or again) in place
        print("interrupted (SIGINT)", file=sys.stderr)
        return 130


def _main(argv) -> int:
    try:
        if parse_args(argv).dry_run:
            print(dry_run(argv))
            return 0
        notices: list = []
        cfg = load(argv, notices=notices)
        for line in notices:
            print(f"notice: {line}", file=sys.stderr)
        # Before the quickstart preparation (an SFT warm start) and before Ray: a wrong vLLM, TE or
        # transformers fails here in one line, not at the first weight sync.
        check_stack(device.has_gpu())
        checked = None if cfg.prepare.enable else preflight.check_run(cfg)
        from hybridflow.trainer.session import RunFailed, Trainer  # lazy: Ray and the workers, once checked

        trainer = Trainer(cfg, checked=checked)  # with prepare.enable: prepares, then checks
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        with trainer:
            if trainer.resume_from is not None and trainer.done:
                print(f"nothing to do: {trainer.resume_from} is the last step ({trainer.total_steps})", file=sys.stderr)
                return 0
            trainer.fit()
    except ConfigError as e:  # a joined Ray cluster too small
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        aside = set_aside_metrics(cfg.trainer.output_dir) if e.checkpoint is None else None
        moved = f" (no checkpoint yet: the rerun starts over; this run's metrics are in {aside})" if aside else ""
        print(f"preempted: {e}{moved}", file=sys.stderr)
        return EXIT_PREEMPTED
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the driver's own writes (metrics, trackers) on a full or read-only disk
        if e.errno not in _DISK_ERRNOS:
            raise
        where = e.filename or f"in trainer.output_dir={cfg.trainer.output_dir}"  # a buffered write names no file
        print(f"error: cannot write {where}: {e.strerror}; last good checkpoint: {trainer.last_checkpoint or 'none'}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
