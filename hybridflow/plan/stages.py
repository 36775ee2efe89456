"""Which decoder layers each pipeline stage holds: the one owner of megatron-core's layer placement, read by
conversion (megatron.convert.Shard.layers), resharding (transition, bytes formula), export and the run plan's
checks. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

# The role's override_transformer_config keys that split the stages unevenly, as megatron's TransformerConfig names them
STAGE_LAYER_KEYS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


def stage_layers_of(overrides: dict | None) -> tuple[int | None, int | None]:
    """(first, last): the layers a role's override_transformer_config puts on its first and last pipeline stage
    (None: the even split)."""
    first, last = ((overrides or {}).get(k) for k in STAGE_LAYER_KEYS)
    return first, last


@dataclass(frozen=True)
class StageSplit:
    """Layers over ``pp`` pipeline stages as megatron-core 0.16.1 places them (transformer_block.
    get_num_layers_to_build, transformer_layer.get_transformer_layer_offset): ``first`` / ``last`` layers on the
    first / last stage where set (its TransformerConfig's num_layers_in_first/last_pipeline_stage: uneven stages,
    as verl's Moonlight and DeepSeek-V3 scripts set them), the rest evenly over the other stages; with virtual
    stages each stage's layers in ``vpp`` equal chunks, chunk c of every stage before chunk c + 1 of any."""

    pp: int = 1
    vpp: int = 1
    first: int | None = None
    last: int | None = None

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def counts(self, num_layers: int) -> list[int]:
        """Each stage's number of layers."""
        ends = {0: self.first, self.pp - 1: self.last}
        fixed = {s: n for s, n in ends.items() if n is not None}
        others = self.pp - len(fixed)
        each = (num_layers - sum(fixed.values())) // others if others else 0
        return [fixed.get(s, each) for s in range(self.pp)]

    def layers(self, num_layers: int, stage: int) -> list[int]:
        """The global index of each of stage ``stage``'s layers in local order (``decoder.layers.{local}``)."""
        chunk = [n // self.vpp for n in self.counts(num_layers)]
        per_round = sum(chunk)  # one chunk of every stage
        start = sum(chunk[:stage])
        return [c * per_round + start + j for c in range(self.vpp) for j in range(chunk[stage])]

    def check(self, num_layers: int, key: str, source: str) -> None:
        """One line where megatron would refuse the split of ``num_layers`` (``key``: the role's megatron section;
        ``source``: the model's config file)."""
        if not self.uneven:
            if num_layers % self.pp:
                raise ValueError(f"{key}.pipeline_model_parallel_size ({self.pp}) does not divide the model's "
                                 f"{num_layers} layers in {source} (override_transformer_config."
                                 "num_layers_in_first/last_pipeline_stage can place the rest)")
            if num_layers % (self.pp * self.vpp):
                raise ValueError(f"{key}.virtual_pipeline_model_parallel_size ({self.vpp}) x "
                                 f"pipeline_model_parallel_size ({self.pp}) does not divide the model's {num_layers} "
                                 f"layers in {source}")
            return
        name = f"{key}.override_transformer_config.num_layers_in_{'first' if self.first is not None else 'last'}" \
               "_pipeline_stage"
        if self.pp < 2:
            raise ValueError(f"{name}: uneven pipeline stages need pipeline_model_parallel_size > 1")
        rest = num_layers - (self.first or 0) - (self.last or 0)
        others = self.pp - (self.first is not None) - (self.last is not None)
        if rest < 0 or (rest % others if others else rest):
            raise ValueError(f"{name}: the model's {num_layers} layers in {source} leave {rest} for the other "
                             f"{others} pipeline stages, which must divide evenly")
        counts = self.counts(num_layers)
        if min(counts) < self.vpp or any(n % self.vpp for n in counts):
            raise ValueError(f"{name}: every stage's layers {counts} must divide into the "
                             f"{self.vpp} virtual stages, a layer each at least")
