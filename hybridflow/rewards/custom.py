"""User reward functions loaded from a python file, with verl's custom-reward signature:

    fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict (with a "score" key)

Every load problem is reported up front, naming the config key and the file, so a typo fails at
startup instead of at the first scored batch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import numbers
import sys
from pathlib import Path
from typing import Any, Callable

_PATH_KEY = "custom_reward_function.path"
_NAME_KEY = "custom_reward_function.name"


class CustomRewardFunction:
    """The loaded user function; always passes ``extra_info`` by keyword, as verl does."""

    def __init__(self, fn: Callable, path: str, name: str):
        self.fn, self.path, self.name = fn, path, name

    def __call__(self, data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None):
        return self.fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                       extra_info=extra_info)

    def __reduce__(self):
        # The module is not importable by name elsewhere (e.g. in a Ray worker): re-load from the file.
        return load_custom_reward_function, (self.path, self.name)

    def __repr__(self) -> str:
        return f"custom reward function {self.name!r} from {self.path}"


def _import_file(path: Path):
    # A per-path module name keeps two reward files with the same stem from replacing each other.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"hybridflow_custom_reward_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{_PATH_KEY}={path}: not loadable as a python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses/pickle inside the user file look themselves up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ImportError(f"{_PATH_KEY}={path}: importing the file failed: {type(e).__name__}: {e}") from e
    return module


def load_custom_reward_function(path: str, name: str = "compute_score") -> CustomRewardFunction:
    """Load ``name`` from the python file at ``path`` and check it accepts verl's reward call."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{_PATH_KEY}={path}: file not found")
    module = _import_file(file)

    if not hasattr(module, name):
        callables = sorted(k for k, v in vars(module).items()
                           if callable(v) and not k.startswith("_") and not inspect.ismodule(v))
        raise AttributeError(f"{_NAME_KEY}={name!r}: no such function in {file}; "
                             f"callables there: {', '.join(callables) or '(none)'}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{_NAME_KEY}={name!r} in {file} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn):
        raise TypeError(f"{_NAME_KEY}={name!r} in {file} is async; rule scoring here calls it synchronously")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None  # some builtins/C callables have no signature: trust them, errors surface on call
    if signature is not None:
        try:
            signature.bind(data_source="", solution_str="", ground_truth="", extra_info=None)
        except TypeError as e:
            raise TypeError(
                f"{_NAME_KEY}={name!r} in {file} has signature {name}{signature}, which cannot be called as "
                f"{name}(data_source=..., solution_str=..., ground_truth=..., extra_info=...): {e}") from None
    return CustomRewardFunction(fn, str(file), name)


def _describe(fn: Callable) -> str:
    if isinstance(fn, CustomRewardFunction):
        return repr(fn)
    return f"reward function {getattr(fn, '__qualname__', repr(fn))!r}"


def _custom_scorer(fn: Callable, data_source: str, response: str, ground_truth: str) -> float:
    result = fn(data_source, response, ground_truth, extra_info=None)
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"{_describe(fn)} returned a dict without a 'score' key (keys: {sorted(result)})")
        result = result["score"]
    # bool is a number to verl too (float(True) == 1.0); strings and tensors are not accepted
    if not isinstance(result, numbers.Real):
        raise TypeError(f"{_describe(fn)} returned {type(result).__name__} {result!r}; "
                        "expected a number or a dict with a numeric 'score'")
    return float(result)


def adapt_to_scorer(fn: Callable, data_source: str = "custom") -> Callable[[str, str], float]:
    """A suite scorer ``(response_text, ground_truth) -> float`` calling ``fn`` with ``data_source``.

    A partial of a module-level function (not a lambda), so it pickles when ``fn`` does.
    """
    return functools.partial(_custom_scorer, fn, data_source)
