"""megatron-core models for the actor, critic and reference: building, conversion, training."""

import warnings

# Expected on CPU and on GPUs without Apex: megatron falls back to torch implementations.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
