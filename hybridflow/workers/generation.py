"""Generation on a vLLM engine as a Batch in verl's layout: single-turn responses or multi-turn trajectories,
with vLLM's log-prob of each sampled token. Shared by the colocated actor worker and the standalone rollout
worker, so both produce the same rows from the same prompts."""

from __future__ import annotations

import torch

from hybridflow import device
from hybridflow.agent.chat import ChatFormat
from hybridflow.agent.loop import AgentLoop, AgentSettings, trajectory_columns
from hybridflow.agent.parsers import get_parser
from hybridflow.agent.tools import load_tools
from hybridflow.megatron import routing
from hybridflow.protocol import Batch
from hybridflow.resharding.vllm_layout import to_checkpoint_names
from hybridflow.rollout.vllm_rollout import EngineSettings, SamplingSettings, VLLMRollout


def responses_to_batch(prompts: Batch, responses: list[list[int]], max_len: int, pad_id: int,
                       eos_id: int) -> Batch:
    """Right-pad responses and append them to the left-padded prompts (verl's layout)."""
    n = len(responses)
    resp = torch.full((n, max_len), pad_id, dtype=torch.long)
    resp_mask = torch.zeros((n, max_len), dtype=torch.long)
    for i, r in enumerate(responses):
        r = r[:max_len]
        if eos_id in r:
            r = r[: r.index(eos_id) + 1]  # EOS is part of the response (it is an action)
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        resp_mask[i, : len(r)] = 1
    return Batch.from_dict(tensors=_after_prompts(prompts, resp, resp_mask, resp_mask))


def _after_prompts(prompts: Batch, responses: torch.Tensor, response_mask: torch.Tensor, real: torch.Tensor) -> dict:
    """The responses appended to the left-padded prompts: ``real`` marks the response's tokens (padding 0),
    ``response_mask`` those the model sampled."""
    attention = torch.cat([prompts.tensors["attention_mask"], real], dim=1)
    return {"responses": responses, "response_mask": response_mask,
            "input_ids": torch.cat([prompts.tensors["input_ids"], responses], dim=1), "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)}


def trajectories_to_batch(prompts: Batch, trajectories, max_len: int, pad_id: int) -> Batch:
    """Multi-turn trajectories (agent/loop.py) in verl's layout: ``responses`` hold sampled and tool-message
    tokens, ``attention_mask`` is 1 on both, ``response_mask`` only on sampled ones, ``rollout_log_probs`` is
    vLLM's log-prob on sampled tokens (0 elsewhere), plus the per-row agent statistics."""
    n = len(trajectories)
    resp = torch.full((n, max_len), pad_id, dtype=torch.long)
    resp_mask, real = torch.zeros((n, max_len), dtype=torch.long), torch.zeros((n, max_len), dtype=torch.long)
    log_probs = torch.zeros((n, max_len), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        k = min(len(t.response_ids), max_len)
        resp[i, :k] = torch.tensor(t.response_ids[:k], dtype=torch.long)
        resp_mask[i, :k] = torch.tensor(t.response_mask[:k], dtype=torch.long)
        real[i, :k] = 1
        log_probs[i, :k] = torch.tensor(t.log_probs[:k], dtype=torch.float32)
    tensors, non_tensors = trajectory_columns(trajectories)
    if trajectories and trajectories[0].routes is not None:  # R3: tool tokens after the last turn have none
        tensors["routed_experts"] = routes_grid(prompts, real, [t.routes for t in trajectories])
    return Batch.from_dict(tensors={**_after_prompts(prompts, resp, resp_mask, real), "rollout_log_probs": log_probs,
                                    **tensors}, non_tensors=non_tensors)


def routes_grid(prompts: Batch, response_mask: torch.Tensor, routes: list) -> torch.Tensor:
    """vLLM's routes of each row ([prompt + response - 1, layers, k], workers' ``generate_with_log_probs``) on the
    batch's token grid [b, P + R, layers, k] int16: the left-padded prompt's cells, then the kept response's
    (``response_mask``: its tokens, a trajectory's tool messages included); ``NO_ROUTE`` where no token was routed
    (padding, a response's last token, tokens past a cut or after the last request)."""
    P = prompts.tensors["input_ids"].shape[1]
    kept = response_mask.sum(1)
    out = torch.full((len(routes), P + response_mask.shape[1], *routes[0].shape[1:]), routing.NO_ROUTE,
                     dtype=torch.int16)
    for i, (r, lp) in enumerate(zip(routes, prompts.tensors["attention_mask"].sum(1).tolist())):
        r = torch.as_tensor(r, dtype=torch.int16)
        n = min(lp + int(kept[i]), len(r))
        out[i, P - lp:P - lp + n] = r[:n]
    return out


def rollout_log_probs(log_probs: list[list[float]], response_mask: torch.Tensor) -> torch.Tensor:
    """vLLM's per-token log-probs as a float32 [b, R] tensor aligned with ``responses``, 0 at padding (a
    response cut at EOS or max length keeps the log-probs of the tokens it keeps)."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i, (lp, n) in enumerate(zip(log_probs, response_mask.sum(-1).tolist())):
        out[i, :n] = torch.tensor(lp[:n], dtype=torch.float32)
    return out


def build_agent_loop(multi_turn, max_response_length: int, chat_template_kwargs: dict, tokenizer):
    """The multi-turn agent loop of ``rollout.multi_turn``: its tools (verl's tool config), tool-call parser and
    the tokenizer's chat template."""
    m = multi_turn
    tools = load_tools(m.tool_config_path)
    return AgentLoop(tokenizer, tools, get_parser(m.format, tokenizer, [t.schema for t in tools.values()]),
                     AgentSettings.from_config(m, max_response_length), ChatFormat(tokenizer, chat_template_kwargs))


def build_vllm_rollout(spec, seed: int, generation_groups, colocated: bool) -> VLLMRollout:
    """The vLLM engine of ``spec.rollout`` (the actor's or the rollout pool's spec), of the model folder its
    ``process`` names, with dummy weights until the
    first sync; ``generation_groups``: the ranks of each vLLM TP group of this process's world. Only an engine
    ``colocated`` with training sleeps outside generation (rollout.free_cache_engine): a pool of its own has no one to
    give its memory to, and sleeping it around a batch generation (validation, a greedy baseline) only moved its
    weights to the host and back."""
    r, p = spec.rollout, spec.process
    return VLLMRollout(p.model_path, EngineSettings.of(r, colocated, p),
                       max_model_len=spec.max_prompt_length + spec.max_response_length, seed=seed,
                       generation_groups=generation_groups, routed_experts=r.enable_rollout_routing_replay,
                       lora_rank=adapter_rank(spec))


def adapter_rank(spec) -> int:
    """The rank of the LoRA adapter the engine takes (model.lora.merge false), else 0: merged weights or none."""
    lora = getattr(spec, "lora", None)  # the rollout pool's spec has none: separate_async takes merged weights
    return lora.rank if lora is not None and not lora.merge else 0


def load_adapters(rollout: VLLMRollout, actor, lora, base_model: str) -> int:
    """The actor's current adapters, gathered whole on every rank (lora_peft.gathered), into the engine's LoRA;
    returns the bytes handed over."""
    from hybridflow.megatron import lora_peft

    tensors = lora_peft.gathered(actor.module, actor.hf_config, actor.shard)
    rollout.load_adapter(tensors, lora_peft.adapter_config(tensors, lora.rank, lora.alpha, 0.0, base_model))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_generation_shard(rollout: VLLMRollout, items, hf_config, k: int, t_g: int, stats) -> None:
    """Load this rank's vLLM TP shard k of t_g ((vLLM name, tensor) pairs, consumed as produced) into the
    engine in place: as is where vLLM's parameters are that layout (GPU), else by checkpoint names through
    vLLM's loaders (vLLM-CPU repacks its weights); MoE experts straight into vLLM's fused expert weights where
    they keep the shard's layout (``VLLMRollout.experts_in_place``)."""
    items = rollout.experts_in_place(items)
    if rollout.takes_shards:
        rollout.update_weights(items, shards=True)
    else:
        rollout.update_weights(to_checkpoint_names(items, hf_config, k=k, t_g=t_g, stats=stats))


def sampling_settings(spec, meta: dict) -> SamplingSettings:
    """The rollout section's sampling, with a batch's ``meta`` overrides (validation's val_kwargs, greedy)."""
    r = spec.rollout
    return SamplingSettings(temperature=meta.get("temperature", r.temperature), top_p=meta.get("top_p", r.top_p),
                            top_k=meta.get("top_k", r.top_k),
                            max_new_tokens=meta.get("max_new_tokens", spec.max_response_length))


def generate_batch(rollout, agent, prompts: Batch, spec, tokenizer) -> Batch:
    """Sample one response per row of ``prompts`` on ``rollout`` (a VLLMRollout; ``agent``: the multi-turn
    loop or None). ``spec``: the run plan's spec holding the rollout section and the length limits.
    ``prompts.meta`` may override sampling: ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (validation's
    rollout.val_kwargs), ``max_new_tokens``, and add ``stop_token_ids`` (an agent endpoint's turn ends). A
    ``sample_seed`` column seeds each single-turn row's sampling, a ``max_new_tokens`` column budgets it."""
    sampling = sampling_settings(spec, prompts.meta)
    ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"].bool()
    prompt_ids = [row[m].tolist() for row, m in zip(ids, mask)]
    sampled = sampling.temperature > 0  # sampled rollouts carry vLLM's log-prob of each token; greedy ones none
    rollout.wake_up(["weights", "kv_cache"])
    if agent is not None:  # multi-turn: turns of generation and tool calls (agent/loop.py)
        trajectories = agent.run(rollout, prompt_ids, sampling, log_probs=sampled)
        rollout.sleep()
        new = trajectories_to_batch(prompts, trajectories, spec.max_response_length,
                                    tokenizer.pad_token_id)
        if not sampled:
            del new.tensors["rollout_log_probs"]
    else:
        seeds, budgets = prompts.tensors.get("sample_seed"), prompts.tensors.get("max_new_tokens")
        outs = rollout.generate_with_log_probs(prompt_ids, sampling, log_probs=sampled,
                                               seeds=None if seeds is None else seeds.tolist(),
                                               max_new_tokens=None if budgets is None else budgets.tolist(),
                                               stop_token_ids=prompts.meta.get("stop_token_ids"),
                                               with_routes=rollout.routed_experts)
        rollout.sleep()
        new = responses_to_batch(prompts, [o[0] for o in outs], spec.max_response_length,
                                 tokenizer.pad_token_id, tokenizer.eos_token_id)
        if sampled:
            new.tensors["rollout_log_probs"] = rollout_log_probs([o[1] for o in outs], new.tensors["response_mask"])
        if rollout.routed_experts:  # R3: the experts vLLM routed every token to
            new.tensors["routed_experts"] = routes_grid(prompts, new.tensors["response_mask"], [o[2] for o in outs])
    return prompts.replace(tensors={"prompts": ids, **new.tensors}, non_tensors=new.non_tensors,
                           meta={"memory": device.memory_stats("memory/generate")})
