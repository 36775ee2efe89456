"""User reward functions loaded from a python file, with verl's custom-reward signature:

    fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict (with a "score" key)

Every load problem is reported up front, naming the config key and the file, so a typo fails at
startup instead of at the first scored batch. A call that fails later (raises, exits, returns no number,
never returns) is a one-line ``RewardFunctionError`` naming the function, the row and the value.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import numbers
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

_PATH_KEY = "custom_reward_function.path"
_NAME_KEY = "custom_reward_function.name"
_WAIT_SLICE_S = 0.5  # the driver asks between slices whether to stop waiting (a SIGTERM past its grace period)


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


_IMPORTED: dict[tuple, object] = {}  # (path, mtime, size) -> module: a run's checks and driver import it once


def _import_file(path: Path):
    stat = path.stat()
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _IMPORTED:
        _IMPORTED[key] = _exec_file(path)
    return _IMPORTED[key]


def _exec_file(path: Path):
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


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


class BadRewardValue(TypeError):
    """The function returned something that is not a score."""


class RewardFunctionError(RuntimeError):
    """A user reward function failed on one row of a batch: it raised (SystemExit and KeyboardInterrupt
    too), returned no finite number, or did not return in time. One line; ``row`` is the row's index in
    the batch, for the caller to describe."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


class CustomScorer:
    """A user reward function as a suite scorer. Each row is scored as verl's reward loop scores it: with
    the row's data source (its ``source_key`` column, data.reward_fn_key; ``data_source`` for rows without
    one), ground truth and ``extra_info`` (see ``verl_extra_info``). ``score_all`` scores a batch with at most
    ``timeout_s`` per call (None: no limit). Pickles when ``fn`` does."""

    def __init__(self, fn: Callable, data_source: str = "custom", timeout_s: float | None = None,
                 source_key: str = "data_source"):
        self.fn, self.data_source, self.timeout_s, self.source_key = fn, data_source, timeout_s, source_key

    def __call__(self, response: str, ground_truth: Any, data_source: str | None = None,
                 extra_info: Any = None) -> float:
        return self.score(response, ground_truth, data_source, extra_info)[0]

    def score(self, response: str, ground_truth: Any, data_source: str | None = None,
              extra_info: Any = None) -> tuple[float, dict]:
        """The score and the function's other returned entries (a returned dict's keys besides ``score``, which
        verl keeps as reward_extra_info: batch columns, e.g. gdpo's reward components)."""
        result = self.fn(self.data_source if data_source is None else data_source, response, ground_truth,
                         extra_info=extra_info)
        entries = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise BadRewardValue(f"{_describe(self.fn)} returned a dict without a 'score' key "
                                     f"(keys: {sorted(map(str, result))})")
            entries = {k: v for k, v in result.items() if k != "score"}
            result = result["score"]
        # bool is a number to verl too (float(True) == 1.0); strings and tensors are not accepted
        if not isinstance(result, numbers.Real):
            raise BadRewardValue(f"{_describe(self.fn)} returned {type(result).__name__} {_one_line(repr(result))}; "
                                 "expected a number or a dict with a numeric 'score'")
        if not math.isfinite(result):  # one NaN reward poisons the advantages of its whole batch (or group)
            raise BadRewardValue(f"{_describe(self.fn)} returned {result!r}; expected a finite number")
        if abs(result) > FLOAT32_MAX:  # the batch holds scores in float32: this one would be inf there
            raise BadRewardValue(f"{_describe(self.fn)} returned {result!r}, beyond float32's range (the batch's "
                                 f"scores; +-{FLOAT32_MAX:.3g}): it would be inf there")
        return float(result), entries

    def score_all(self, responses: list[str], ground_truths: list, sources: list | None = None,
                  extra_infos: list | None = None) -> list[float]:
        """Every row's score (``score_all_with_entries`` without the entries)."""
        return self.score_all_with_entries(responses, ground_truths, sources, extra_infos)[0]

    def score_all_with_entries(self, responses: list[str], ground_truths: list, sources: list | None = None,
                               extra_infos: list | None = None) -> tuple[list[float], list[dict]]:
        """Every row's score, in order, or a ``RewardFunctionError`` for the first row that fails;
        ``sources`` and ``extra_infos`` per row (None: ``data_source`` and no extra_info for every row).

        The calls run on a helper thread while this one waits: a call that never returns is abandoned after
        ``timeout_s`` (a thread cannot be killed; it stays blocked as a daemon, which does not keep the
        process alive while the run ends), and a real Ctrl-C still reaches the caller (signals go to the
        main thread) while a KeyboardInterrupt the function raises itself is reported as its failure.
        signal.alarm instead would interrupt only Python code on the main thread and clash with a
        function's own alarm; verl's reward loop also calls these functions from an executor thread."""
        scores: list[float] = []
        entries: list[dict] = []
        failure: list[BaseException] = []
        current = (0, time.monotonic())  # (row being scored, when its call began): swapped whole
        done = threading.Event()

        sources = [None] * len(responses) if sources is None else sources
        extra_infos = [None] * len(responses) if extra_infos is None else extra_infos

        def score_rows() -> None:
            nonlocal current
            try:
                for row, (response, truth, source, extra) in enumerate(zip(responses, ground_truths, sources,
                                                                          extra_infos)):
                    current = (row, time.monotonic())
                    score, returned = self.score(response, truth, source, extra)
                    scores.append(score)
                    entries.append(returned)
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: the function's, not ours
                failure.append(e)
            finally:
                done.set()

        def time_left() -> float | None:  # of the call in progress
            return None if self.timeout_s is None else max(0.0, current[1] + self.timeout_s - time.monotonic())

        threading.Thread(target=score_rows, name="custom reward function", daemon=True).start()
        while not done.wait(_WAIT_SLICE_S if time_left() is None else min(_WAIT_SLICE_S, time_left())):
            row, began = current
            if self.timeout_s is not None and time.monotonic() - began >= self.timeout_s:
                raise RewardFunctionError(f"{_describe(self.fn)} did not return within custom_reward_function."
                                          f"timeout_s={self.timeout_s:g} s", row)
            _give_up_if_asked(self.fn)
        if failure:
            raise RewardFunctionError(self._failure(failure[0]), row=len(scores))
        return scores, entries

    def _failure(self, error: BaseException) -> str:
        if isinstance(error, BadRewardValue):
            return str(error)
        if isinstance(error, SystemExit):
            return f"{_describe(self.fn)} called sys.exit({error.code!r})"
        detail = f": {_one_line(error)}" if str(error) else ""
        return f"{_describe(self.fn)} raised {type(error).__name__}{detail}"


def _give_up_if_asked(fn: Callable) -> None:
    """``WaitAbandoned`` when the driver stops waiting (controller.worker_group.give_up_waiting_when: the
    trainer after SIGTERM's grace period); the call left running is a daemon thread."""
    controller = sys.modules.get("hybridflow.controller.worker_group")
    if controller is None:  # not imported, so no driver installed a check (a scorer used on its own)
        return
    reason = controller.give_up_reason()
    if reason is not None:
        raise controller.WaitAbandoned(f"stopped waiting for {_describe(fn)}: {reason}")


def adapt_to_scorer(fn: Callable, data_source: str = "custom", timeout_s: float | None = None,
                    source_key: str = "data_source") -> CustomScorer:
    """A suite scorer calling ``fn`` with each row's source (column ``source_key``, data.reward_fn_key;
    ``data_source`` where a row has none); ``timeout_s``: custom_reward_function.timeout_s."""
    return CustomScorer(fn, data_source, timeout_s, source_key)


def verl_extra_info(extra: Any) -> Any:
    """What verl's single-turn reward loop passes as ``extra_info`` for a row whose data holds ``extra``
    (``experimental/reward_loop/reward_manager/naive.py``): a copy of the row's extra_info ({} when it has
    none) with ``num_turns`` (2: the prompt and the response, ``SingleTurnAgentLoop``'s count) and
    ``rollout_reward_scores`` ({}). A non-dict value is passed unchanged."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        return extra
    return {**extra, "num_turns": 2, "rollout_reward_scores": {}}
