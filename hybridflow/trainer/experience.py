"""Driver-side algorithm steps on a rollout batch: rewards, KL-in-reward, advantages."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow import rng
from hybridflow.agent.vllm_parsers import HARMONY_CHANNEL, harmony_final
from hybridflow.algorithms import ADVANTAGE_ESTIMATORS, compute_advantage, kl_penalty, masked_mean
from hybridflow.config.distillation import routing_keys
from hybridflow.protocol import Batch
from hybridflow.rewards import on_last_token, score_batch
from hybridflow.rewards.custom import CustomScorer, RewardFunctionError, verl_extra_info
from hybridflow.rewards.episode import EpisodeRewards
from hybridflow.rewards.routing import SourceRouter


def score_responses(batch: Batch, tokenizer, scorer) -> Batch:
    """Decode responses and score them against their ground truth (the ``answer`` column); adds ``scores``,
    ``token_level_scores`` and ``response_text``. ``scorer``: a ``SourceRouter`` or ``CustomScorer`` (each row
    with its source, read from the scorer's ``source_key`` column, and its extra_info), or a plain
    ``(response, answer) -> float``. A user reward function that fails is a one-line ``RewardFunctionError``
    naming the row (its prompt and response). An ``EpisodeRewards`` scorer keeps an agent episode's own reward."""
    if isinstance(scorer, EpisodeRewards):
        return scorer.apply(score_responses(batch, tokenizer, scorer.inner))
    mask = batch.tensors["response_mask"]
    texts = [sampled_text(tokenizer, r, m) for r, m in zip(batch.tensors["responses"], mask)]
    answers = list(batch.non_tensors["answer"])
    if isinstance(scorer, (CustomScorer, SourceRouter)):
        sources = batch.non_tensors.get(scorer.source_key)
        extra_column = batch.non_tensors.get("extra_info")
        extras = [verl_extra_info(e) for e in (extra_column if extra_column is not None else [None] * len(texts))]
        sources = None if sources is None else list(sources)
        try:
            if isinstance(scorer, CustomScorer):
                scores, entries = scorer.score_all_with_entries(texts, answers, sources, extras)
            else:
                scores, entries = scorer.score_all(texts, answers, sources, extras), []
        except RewardFunctionError as e:
            raise RewardFunctionError(f"{e} on {_describe_row(batch, tokenizer, texts, e.row)}", e.row) from e
        scores = torch.tensor(scores, dtype=torch.float32)
        token_scores = on_last_token(scores, mask)
    else:
        scores, token_scores = score_batch(scorer, texts, answers, mask)
        entries = []
    return batch.union(Batch.from_dict(tensors={"scores": scores, "token_level_scores": token_scores},
                                       non_tensors={"response_text": np.array(texts, dtype=object),
                                                    **returned_entries(entries)}))


def sampled_text(tokenizer, response: torch.Tensor, mask: torch.Tensor) -> str:
    """The text the model wrote: each run of sampled tokens decoded on its own, runs joined by newlines. A
    multi-turn response's tool messages (mask 0) are left out, so a scorer never rewards text a tool wrote; verl
    0.9.1 decodes the whole response, tool messages included (a deliberate difference). A run in gpt-oss's harmony
    format counts its final channel only (_decoded_run)."""
    m = mask.bool().tolist()
    ids, runs, start = response.tolist(), [], None
    harmony = HARMONY_CHANNEL in tokenizer.get_added_vocab()
    for i, on in enumerate(m + [False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append(_decoded_run(tokenizer, ids[start:i], harmony))
            start = None
    return "\n".join(runs)


def _decoded_run(tokenizer, ids: list[int], harmony: bool) -> str:
    """One run of sampled tokens as text. With a harmony tokenizer (gpt-oss), a run in the format is its answer:
    the final channel's messages, its analysis (reasoning) and commentary left out, "" where the length budget cut it
    before its answer. Deliberate difference: verl 0.9.1 scores the whole decoded response, reasoning included, so a
    number in the reasoning can pass for the answer."""
    if harmony:
        final = harmony_final(tokenizer.decode(ids, skip_special_tokens=False))
        if final is not None:
            return final
    return tokenizer.decode(ids, skip_special_tokens=True)


def returned_entries(entries: list[dict]) -> dict:
    """A reward function's other returned entries as batch columns (verl's reward_extra_info: ``np.array`` of
    each key's values), for the keys every row returned (gdpo's components, a dynamic-sampling metric)."""
    if not entries:
        return {}
    keys = set(entries[0]).intersection(*entries[1:])
    return {k: np.array([e[k] for e in entries]) for k in sorted(keys, key=str) if isinstance(k, str)}


def _describe_row(batch: Batch, tokenizer, responses: list[str], row: int) -> str:
    """Row ``row`` of the batch as a user finds it again: its data_source (when the data has one), prompt
    and response, shortened."""
    def short(text) -> str:
        text = str(text)
        return repr(text if len(text) <= 60 else text[:57] + "...")

    prompts = batch.tensors["prompts"]
    prompt = prompts[row][batch.tensors["attention_mask"][row, :prompts.shape[1]].bool()]
    source = batch.non_tensors.get("data_source")
    return (f"row {row} of {len(batch)} of the batch ({'' if source is None else f'data_source {short(source[row])}, '}"
            f"prompt {short(tokenizer.decode(prompt.tolist(), skip_special_tokens=True))}, "
            f"response {short(responses[row])})")


def apply_kl_in_reward(batch: Batch, kl_coef: float, kind: str) -> tuple[Batch, float]:
    """token_level_rewards = scores - coef * KL(actor || ref) per token; returns the mean KL too."""
    mask = batch.tensors["response_mask"]
    kld = kl_penalty(batch.tensors["old_log_probs"], batch.tensors["ref_log_prob"], kind) * mask
    rewards = batch.tensors["token_level_scores"] - kl_coef * kld
    current_kl = masked_mean(kld, mask, dim=-1).mean().item()
    return batch.union(Batch.from_dict(tensors={"token_level_rewards": rewards})), current_kl




def _gdpo_reward_components(batch: Batch, algo) -> dict:
    """gdpo's per-row reward components: the batch columns named by ``algorithm.gdpo_reward_keys`` (the
    reward function's returned dict entries, as verl reads them from its non_tensor_batch)."""
    if not algo.gdpo_reward_keys:
        raise ValueError("adv_estimator gdpo requires algorithm.gdpo_reward_keys (the reward components "
                         "returned by the reward function, e.g. [format_reward, accuracy_reward])")
    columns = {**batch.non_tensors, **batch.tensors}
    missing = [k for k in algo.gdpo_reward_keys if k not in columns]
    if missing:
        raise ValueError(f"gdpo reward key(s) {missing} not in the batch (columns: {sorted(columns)}); the "
                         "reward function must return a dict holding them")
    return {k: columns[k] for k in algo.gdpo_reward_keys}


def add_advantages(batch: Batch, algo) -> Batch:
    """``advantages`` and ``returns`` by ``algo.adv_estimator``, given what verl's driver gives each
    estimator: gdpo the reward components (``_gdpo_reward_components``), the optimal token baselines the
    old log-probs, ``sum_pi_squared`` and any ``rollout_is_weights``."""
    t, needs = batch.tensors, ADVANTAGE_ESTIMATORS.needs(algo.adv_estimator)
    if "sum_pi_squared" in needs and "sum_pi_squared" not in t:
        raise ValueError(f"adv_estimator {algo.adv_estimator} needs the actor's sum_pi_squared (the sum of "
                         "squared token probabilities per position, verl's actor.calculate_sum_pi_squared), "
                         "which this batch lacks")
    adv, returns = compute_advantage(
        algo.adv_estimator, t["token_level_rewards"], t["response_mask"], values=t.get("values"),
        index=batch.non_tensors.get("uid"), reward_baselines=t.get("reward_baselines"),
        gamma=algo.gamma, lam=algo.lam, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        old_log_probs=t.get("old_log_probs"), sum_pi_squared=t.get("sum_pi_squared"),
        rollout_is_weights=t.get("rollout_is_weights"),
        reward_components=_gdpo_reward_components(batch, algo) if "reward_components" in needs else None,
        reward_weights=algo.gdpo_reward_weights)
    return batch.union(Batch.from_dict(tensors={"advantages": adv, "returns": returns}))


def response_lengths(batch: Batch) -> torch.Tensor:
    """Tokens per response, a multi-turn response's tool messages included (verl's valid_response_length)."""
    t = batch.tensors
    return t["attention_mask"][:, -t["responses"].shape[1]:].sum(-1)


def rollout_metrics(batch: Batch) -> dict:
    t = batch.tensors
    mask = t["response_mask"].float()
    out = {
        "reward/score_mean": t["scores"].mean().item(),
        **({"reward/rule_score_mean": t["rule_scores"].mean().item()} if "rule_scores" in t else {}),
        "response/length_mean": response_lengths(batch).float().mean().item(),
    }
    if "overlong_reward" in t:  # reward.overlong_buffer.log: DAPO's overlong penalty (verl's overlong_reward)
        out["reward/overlong_reward_mean"] = t["overlong_reward"].mean().item()
        out["reward/overlong_fraction"] = (t["overlong_reward"] < 0).float().mean().item()
    if "entropy" in t:  # else the update reports it (reuse_on_policy_log_prob)
        out["actor/entropy"] = masked_mean(t["entropy"], mask).item()
    if "routing_differing" in t:  # R3: of vLLM's routes replayed, the share the trainer's routers would not choose
        out["actor/routing_replay/differing_fraction"] = (t["routing_differing"].sum()
                                                          / t["routing_counted"].sum().clamp(min=1)).item()
    if "values" in t:
        out["critic/values_mean"] = masked_mean(t["values"], mask).item()
    if "advantages" in t:
        out["critic/advantages_mean"] = masked_mean(t["advantages"], mask).item()
    return out


def sample_seeds(seed: int, uids, n: int) -> torch.Tensor:
    """A sampling seed per row of a batch whose prompts (group ids ``uids``, one per prompt) are repeated ``n``
    times consecutively: from the run's seed, the group id and the sample's index in its group, so a response
    is the same whichever engine and replica samples it (sync or separate pool, any rollout layout)."""
    return torch.tensor([rng.seed_of(seed, uid, i) for uid in uids for i in range(n)], dtype=torch.int64)


def as_group_ids(n_prompts: int, n: int, step: int) -> np.ndarray:
    """Group ids for rollout.n samples per prompt (rows repeated consecutively)."""
    return np.array([f"{step}-{i}" for i in range(n_prompts) for _ in range(n)], dtype=object)



def group_prompts(batch: Batch) -> tuple[Batch, torch.Tensor]:
    """Each group's prompt (its first row's prompt columns, the left-padded ``prompts`` width, and the row's
    other columns) and, per row, the index of its group among them: a generated batch's own prompts, which
    are not the step's when the batch was generated ahead or carried over."""
    first: dict = {}  # uid -> (group index, its first row)
    for row, uid in enumerate(batch.non_tensors["uid"]):
        first.setdefault(uid, (len(first), row))
    groups = torch.tensor([first[uid][0] for uid in batch.non_tensors["uid"]])
    heads = batch[np.array([row for _, row in first.values()])]
    width = heads.tensors["prompts"].shape[1]
    t = heads.tensors
    prompts = Batch.from_dict(tensors={"input_ids": t["prompts"], "attention_mask": t["attention_mask"][:, :width],
                                       "position_ids": t["position_ids"][:, :width]},
                              non_tensors=dict(heads.non_tensors))
    return prompts, groups


def teacher_metrics(batch: Batch, distillation) -> dict:
    """distillation/<teacher key>/kl: the mean over each teacher's response tokens of log pi_student - log
    pi_teacher of the sampled token (the reverse KL's k1 estimate; the student's old log-probs, else vLLM's), and
    distillation/kl over every row; none with forward_kl_topk, whose teachers give their top-k instead (the update's
    actor/distillation/* metrics measure it)."""
    t = batch.tensors
    student = t["old_log_probs"] if "old_log_probs" in t else t.get("rollout_log_probs")
    if student is None or "teacher_log_probs" not in t:  # the update measures it (actor/distillation/...)
        return {}
    k1, mask = (student - t["teacher_log_probs"]).float(), t["response_mask"].float()
    out = {"distillation/kl": float(masked_mean(k1, mask))}
    teachers = distillation.teachers()
    if None not in teachers:
        keys = np.asarray(routing_keys(batch.non_tensors[distillation.teacher_key]), dtype=object)
        for key in teachers:
            rows = torch.as_tensor(keys == key)
            if rows.any():
                out[f"distillation/{key}/kl"] = float(masked_mean(k1[rows], mask[rows]))
    return out
