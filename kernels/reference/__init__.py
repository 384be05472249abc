"""PyTorch references of the kernels: the semantics every backend must reproduce."""

from kernels.reference.sampling import (
    GREEDY_TEMPERATURE,
    draw_exponentials,
    draw_uniforms,
    exponential_race,
    is_greedy,
    sample_tokens,
    target_probs,
)
from kernels.reference.verify import verify_chain

__all__ = [
    "GREEDY_TEMPERATURE",
    "draw_exponentials",
    "draw_uniforms",
    "exponential_race",
    "is_greedy",
    "sample_tokens",
    "target_probs",
    "verify_chain",
]
