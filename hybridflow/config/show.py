"""Every resolved value of a config and where it came from (the schema's default, a file, or an override)."""

from __future__ import annotations

import yaml

from hybridflow.config.loader import config_to_dict, flat_items


def render(cfg, sources: dict[str, str]) -> str:
    """One ``key = value  # source`` line per resolved value (source: a file, an override, or default)."""
    rows = [(key, yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n..."), sources.get(key, "default"))
            for key, value in flat_items(config_to_dict(cfg))]
    width = max(len(k) + len(v) for k, v, _ in rows) + 3
    return "\n".join(f"{f'{k} = {v}':<{width}}# {src}" for k, v, src in rows)
