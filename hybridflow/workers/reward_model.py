"""The reward-model worker: scores prompt+response text with a HF sequence-classification model.

The reward model may use another tokenizer than the policy: responses are decoded with the policy's
tokenizer and re-tokenized with the reward model's (as verl does when the two differ).
"""

from __future__ import annotations

import torch

from hybridflow import device
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import Batch


class RewardModelWorker(Worker):
    def __init__(self, spec):
        """``spec``: the run plan's ``RewardModelSpec``."""
        super().__init__()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        rm = spec.reward_model
        # On this worker's device (its GPU share: an fp32 model on the host would leave it idle and
        # take host memory and time), in the configured dtype.
        self.model = AutoModelForSequenceClassification.from_pretrained(
            rm.path, dtype=device.torch_dtype(rm.dtype)).to(device.current()).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward_model.path {rm.path}: expected one output logit, got num_labels="
                             f"{self.model.config.num_labels}")
        self.tokenizer = AutoTokenizer.from_pretrained(rm.path)
        self.policy_tokenizer = AutoTokenizer.from_pretrained(spec.policy_path, trust_remote_code=spec.trust_remote_code)
        self.micro_batch_size, self.max_length = rm.micro_batch_size, rm.max_length

    def _texts(self, batch: Batch) -> list[str]:
        t = batch.tensors
        prompts = [self.policy_tokenizer.decode(p[m.bool()].tolist(), skip_special_tokens=True)
                   for p, m in zip(t["prompts"], t["attention_mask"][:, : t["prompts"].shape[1]])]
        responses = [self.policy_tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
                     for r, m in zip(t["responses"], t["response_mask"])]
        return [p + r for p, r in zip(prompts, responses)]

    @register(Dispatch.DP_COMPUTE)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """``rm_scores`` [b]: the reward model's logit for each prompt+response."""
        texts = self._texts(batch)
        scores = []
        with torch.no_grad():
            for start in range(0, len(texts), self.micro_batch_size):
                enc = self.tokenizer(texts[start:start + self.micro_batch_size], return_tensors="pt", padding=True,
                                     truncation=True, max_length=self.max_length)
                scores.append(device.to_host(self.model(**device.to_device(dict(enc))).logits[:, 0].float()))
        if device.on_accelerator():
            torch.cuda.empty_cache()  # its activations' blocks back, for vLLM and the colocated roles
        return Batch.from_dict(tensors={"rm_scores": torch.cat(scores)})
