"""`hybridflow` console script: `hybridflow train --config ...` (PPO family), `hybridflow sft ...` and
`hybridflow config show|dump`, `hybridflow export --checkpoint DIR --out HF_DIR` and
`hybridflow check-model MODEL_DIR [--tp N --pp N --ep N --rollout-tp N]`."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sft":
        from hybridflow.trainer.sft import main as sft_main

        return sft_main(argv[1:])
    if argv and argv[0] == "export":
        from hybridflow.tools.export import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "check-model":
        from hybridflow.tools.check_model import main as check_main

        return check_main(argv[1:])
    if argv and argv[0] == "config":
        from hybridflow.config.show import main as config_main

        return config_main(argv[1:])
    if argv and argv[0] == "train":
        argv = argv[1:]
    from hybridflow.trainer.main import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
