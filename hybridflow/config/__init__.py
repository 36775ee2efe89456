"""Config loading; the schema dataclasses live alongside in this package."""

from .loader import ConfigError, config_to_dict, dump_yaml, flat_items, load_config

__all__ = ["ConfigError", "config_to_dict", "dump_yaml", "flat_items", "load_config"]
