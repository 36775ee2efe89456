"""Drive a run from Python: load the quickstart config with overrides, step it, validate, then fit.

    .venv/bin/python examples/python_api.py [OUTPUT_DIR]

The first run prepares the quickstart's data and warm start (as `make run` does). Rerunning continues
from the newest checkpoint in OUTPUT_DIR (trainer.resume_mode=auto). Leaving the `with` block stops every
process the trainer started.
"""

import sys

from hybridflow import Trainer, load_config


def main(output_dir: str = "outputs/python_api") -> list[dict]:
    cfg = load_config("configs/quickstart_cpu.yaml", [f"trainer.output_dir={output_dir}", "trainer.total_steps=6",
                                                      "trainer.val_every=3", "trainer.save_every=3"])
    with Trainer(cfg) as trainer:
        if not trainer.done:
            metrics = trainer.step()  # one PPO step; its metrics as a dict
            print(f"step {trainer.step_count}: reward {metrics['reward/score_mean']:.3f}")
            print("validation:", trainer.validate())
        rows = trainer.fit()  # the remaining steps, with checkpoints and the final HF export
    print(f"{len(rows)} rows in {output_dir}/metrics.jsonl; actor exported to {output_dir}/actor_hf")
    return rows


if __name__ == "__main__":
    main(*sys.argv[1:])
