"""``hybridflow export --checkpoint DIR --out HF_DIR``: a run checkpoint's actor as a HF folder (config,
tokenizer, sharded safetensors with index) that transformers and vLLM load.

One process loads the actor at TP1/PP1 with dist_checkpointing (any saved layout reshards on load) and
streams it out one layer at a time; the optimizer state is not read. DIR may be a checkpoint
(``.../checkpoints/step_<k>``) or a run's output_dir (its latest checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def resolve(path: str) -> Path:
    from hybridflow.trainer import checkpoint

    p = Path(path)
    if checkpoint.is_complete(p):
        return p
    found = checkpoint.latest(str(p))
    if found is None:
        raise FileNotFoundError(f"--checkpoint: {path} is neither a complete checkpoint nor a run folder with one")
    return found


def export(ckpt: Path, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import yaml
    from transformers import AutoConfig, AutoTokenizer

    from hybridflow import device
    from hybridflow.controller.worker import Worker
    from hybridflow.megatron import parallel
    from hybridflow.megatron.checkpoint import load_role
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.workers.export import save_hf_folder

    hf_config = AutoConfig.from_pretrained(str(ckpt / "hf"))
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt / "hf"))
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    dtype = device.torch_dtype(saved["actor"]["megatron"]["dtype"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(Worker.find_free_port()), RANK="0", WORLD_SIZE="1")
    bound = device.bind(0)
    dist.init_process_group("gloo" if bound.type == "cpu" else "nccl", rank=0, world_size=1)
    try:
        parallel.init_model_parallel(1, 1, seed=0)
        actor = MegatronRole(hf_config, None, dtype=dtype)
        load_role(actor, str(ckpt / "actor"), with_optimizer=False)
        with torch.no_grad():
            save_hf_folder(out_dir, hf_config, actor.iter_hf_weights(), tokenizer)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hybridflow export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint folder, or a run's output_dir (latest)")
    ap.add_argument("--out", required=True, help="the HF folder to write (replaced atomically)")
    args = ap.parse_args(argv)
    try:
        ckpt = resolve(args.checkpoint)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    export(ckpt, args.out)
    print(f"exported {ckpt} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
