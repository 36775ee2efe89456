"""Write a HF model folder atomically (a crash never leaves a half-written checkpoint)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def save_hf_folder(out_dir: str, hf_config, state_dict: dict, tokenizer=None) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    hf_config.save_pretrained(str(tmp))
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
