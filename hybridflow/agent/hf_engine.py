"""A transformers model behind the agent loop's engine interface: the warm start evaluates multi-turn tool use
with it, and the tests compare vLLM's trajectories with it."""

from __future__ import annotations

import torch


class HFEngine:
    def __init__(self, model, pad_token_id: int):
        self.model, self.pad_token_id = model, pad_token_id

    @torch.no_grad()
    def generate_with_log_probs(self, prompt_ids: list[list[int]], sampling, *, log_probs: bool = False,
                                max_new_tokens: list[int] | None = None, stop_token_ids: list[int] | None = None
                                ) -> list[tuple[list[int], list[float] | None]]:
        """One continuation per prompt, each ending at its first stop token (kept, as vLLM keeps it) or its
        budget; with ``log_probs``, the model's log-prob of each generated token (before temperature, as
        vLLM's raw_logprobs)."""
        budgets = max_new_tokens or [sampling.max_new_tokens] * len(prompt_ids)
        width = max(map(len, prompt_ids))
        ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        was_training = self.model.training
        self.model.eval()
        sample = sampling.temperature > 0
        out = self.model.generate(
            ids, attention_mask=mask, max_new_tokens=max(budgets), do_sample=sample, pad_token_id=self.pad_token_id,
            eos_token_id=stop_token_ids or None, return_dict_in_generate=True, output_logits=log_probs,
            **({"temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else None} if sample else {}))
        self.model.train(was_training)
        stops = set(stop_token_ids or [])
        results = []
        for i, budget in enumerate(budgets):
            row = out.sequences[i, width:].tolist()[:budget]
            end = next((k + 1 for k, tok in enumerate(row) if tok in stops), len(row))
            row = row[:end]
            lps = None
            if log_probs:
                lps = [torch.log_softmax(out.logits[k][i].float(), -1)[tok].item() for k, tok in enumerate(row)]
            results.append((row, lps))
        return results
