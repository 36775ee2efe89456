"""``hybridflow export --checkpoint DIR --out HF_DIR``: a run checkpoint's actor as a HF folder (config,
tokenizer, sharded safetensors with index) that transformers and vLLM load; a LoRA run's as a peft adapter folder
on its base model (``adapter_model.safetensors``, ``adapter_config.json``), or with ``--merged`` as the HF model
with the adapters merged.

One process loads the actor at TP1/PP1 with dist_checkpointing (any saved layout reshards on load) and
streams it out one layer at a time; the optimizer state is not read. DIR may be a checkpoint
(``.../checkpoints/step_<k>``) or a run's output_dir (its latest checkpoint).

Nothing is lost: before anything is written, a damaged checkpoint is named in one line, and HF_DIR is
refused when it is an existing file or a non-empty folder (``--force`` replaces it, atomically) or when
it is, holds or lies in a run's folder (refused even with ``--force``). Exit status: 0 done; 2 refused;
1 the checkpoint failed to load (damage its files' sizes do not show).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hybridflow.config import ConfigError
from hybridflow.megatron.checkpoint_files import DamagedCheckpoint
from hybridflow.trainer import checkpoint
from hybridflow.workers.export import run_file_in


def resolve(path: str) -> Path:
    """The checkpoint ``--checkpoint`` names, whole (ConfigError naming the damaged file otherwise)."""
    p = Path(path)
    found = p if checkpoint.is_complete(p) else checkpoint.latest(str(p))
    if found is None:
        raise ConfigError(f"--checkpoint: {path} is neither a complete checkpoint nor a run folder with one")
    if (damage := checkpoint.find_damage(found, roles=("actor",), rng=False)) is not None:
        raise ConfigError(f"--checkpoint: checkpoint {found} is damaged: {damage}")
    return found


def check_destination(out_dir: str, force: bool) -> None:
    """ConfigError, before anything is written, when writing ``out_dir`` could destroy data: it lies in a
    run's checkpoints, or it exists (not an empty folder) and is, holds or lies in a run's folder (refused
    even with ``force``); or, without ``force``, it is an existing file or a non-empty folder."""
    out = Path(out_dir).resolve()  # a link to a run is the run
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"--out {out_dir}: {parent} is a file, not a folder")
        if (parent / checkpoint.STATE_FILE).is_file() or (parent / checkpoint.LATEST).is_file():
            raise ConfigError(f"--out {out_dir} lies inside a run's checkpoints ({parent}); "
                              "choose a folder outside them")
    empty_dir = out.is_dir() and next(out.iterdir(), None) is None
    if not out.exists() or empty_dir:
        return
    never = "a run's files are never replaced, even with --force"
    for folder in (out, *out.parents):
        if (marker := run_file_in(folder)) is not None:
            where = "is a run folder" if folder == out else f"lies inside the run folder {folder}"
            raise ConfigError(f"--out {out_dir} {where} (it holds {marker}); {never}")
    if out.is_dir():
        for folder, _, _ in os.walk(out):
            if (marker := run_file_in(Path(folder))) is not None:
                raise ConfigError(f"--out {out_dir} contains the run folder {folder} (it holds {marker}); {never}")
    if force:
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out_dir} is an existing file; pass --force to replace it")
    raise ConfigError(f"--out {out_dir} is a folder that is not empty ({len(list(out.iterdir()))} entries); "
                      "pass --force to replace it")


def check_writable(out_dir: str) -> None:
    """ConfigError, before the checkpoint is loaded, when ``out_dir``'s folder cannot be made or written (a
    read-only disk, no permission, /proc): tried by making and removing a scratch folder there, as the
    export's own temporary folder will be (workers/export.py save_hf_folder). Missing parents are made."""
    import tempfile

    parent = Path(out_dir).resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".hybridflow_export_check_", dir=parent))
    except OSError as e:
        raise ConfigError(f"--out {out_dir}: cannot write in {parent} ({e.strerror or type(e).__name__})") from None


def export(ckpt: Path, out_dir: str, merged: bool = False, force: bool = False) -> None:
    """The checkpoint's actor as a HF folder; a LoRA run's as a peft adapter folder (its base: the run's
    model.path), or with ``merged`` as the HF model with the adapters merged."""
    import torch
    import torch.distributed as dist
    import yaml
    from transformers import AutoConfig, AutoTokenizer

    # lazy, like torch above: `hybridflow export` refuses a bad --checkpoint or --out before torch and Ray load
    from hybridflow import device
    from hybridflow.controller.worker import Worker
    from hybridflow.megatron import parallel
    from hybridflow.megatron.checkpoint import load_role
    from hybridflow.config.model import LoRA
    from hybridflow.megatron.role import MegatronRole, ModelBuild
    from hybridflow.workers.common import lora_settings, open_hf_folder
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
        lora = LoRA(**saved.get("model", {}).get("lora", {}))
        if not lora.rank:
            actor = MegatronRole(hf_config, None, ModelBuild(dtype=dtype))
        else:  # the checkpoint holds the adapters; the frozen base is the run's model
            actor = MegatronRole(hf_config, open_hf_folder(saved["model"]["path"])[1],
                                 ModelBuild(dtype=dtype, lora_settings=lora_settings(lora, seed=0)))
        load_role(actor, str(ckpt / "actor"), with_optimizer=False)
        with torch.no_grad():
            if lora.rank and not merged:
                _save_adapters(actor, lora, saved["model"]["path"], out_dir, force)
            else:
                save_hf_folder(out_dir, hf_config, actor.iter_hf_weights(), tokenizer, replace=force)
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()  # its groups die with the world: a second export in this process makes new ones
        dist.destroy_process_group()


def _save_adapters(actor, lora, base_model: str, out_dir: str, force: bool) -> None:
    from hybridflow.megatron import lora_peft
    from hybridflow.megatron.lora import is_adapter
    from hybridflow.workers.export import save_peft_folder

    full = {k: v for k, v in actor.module.state_dict().items() if is_adapter(k)}  # one rank: whole adapters
    tensors = lora_peft.to_peft(full, actor.hf_config, actor.shard)
    save_peft_folder(out_dir, tensors, lora_peft.adapter_config(tensors, lora.rank, lora.alpha, lora.dropout,
                                                                os.path.abspath(base_model)), replace=force)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hybridflow export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint folder, or a run's output_dir (latest)")
    ap.add_argument("--out", required=True, help="the HF folder to write (a new or empty folder)")
    ap.add_argument("--force", action="store_true",
                    help="replace an existing --out (atomically); never a run's folder or its files")
    ap.add_argument("--merged", action="store_true",
                    help="a LoRA run: the HF model with the adapters merged, not the peft adapter folder")
    args = ap.parse_args(argv)
    try:
        ckpt = resolve(args.checkpoint)
        check_destination(args.out, args.force)
        check_writable(args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        export(ckpt, args.out, merged=args.merged, force=args.force)
    except DamagedCheckpoint as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except FileExistsError as e:  # another export took --out while this one wrote
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
