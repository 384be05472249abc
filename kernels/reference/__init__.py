"""PyTorch references of the kernels: the semantics every backend must reproduce."""

from kernels.reference.sampling import (
    GREEDY_TEMPERATURE,
    draw_exponentials,
    draw_uniforms,
    exponential_race,
    is_greedy,
    sample_tokens,
    target_probs,
    token_draws,
)

# The tree attention function itself is not re-exported: its name is its module's, and binding it here
# would hide the module ``kernels.reference.tree_attention`` from ``import ... as``.
from kernels.reference.tree_attention import ancestor_mask, tree_attention_mask, tree_depths
from kernels.reference.verify import verify_chain

__all__ = [
    "GREEDY_TEMPERATURE",
    "ancestor_mask",
    "draw_exponentials",
    "draw_uniforms",
    "exponential_race",
    "is_greedy",
    "sample_tokens",
    "target_probs",
    "token_draws",
    "tree_attention_mask",
    "tree_depths",
    "verify_chain",
]
