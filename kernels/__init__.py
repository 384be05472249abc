"""Kernels of the target's hot path.

Each op has a PyTorch reference in ``kernels/reference/<op>.py`` (runs anywhere, defines the
semantics) and a Triton kernel in ``kernels/<op>.py`` with the same signature: ``kernels.verify``
(chain verification), ``kernels.sampling`` (the autoregressive draw, on the same kernel),
``kernels.tree`` (tree verification) and ``kernels.compact_kv`` (moving a tree verdict's accepted
path into place in every layer's KV cache); the last two are not yet called by the target
service, which verifies chains only. ``kernels.tree_attention`` is the attention of a verify pass
(the block's tokens over the session's KV prefix and the block under the ancestor mask, GQA,
sliding windows), and ``kernels.hf_attention`` plugs it into transformers models as an
``AttentionInterface`` function (``install(model)``) over the target's own cache. The
target service uses Triton on CUDA and the reference elsewhere (``target_service.verifier``).
Nothing here imports Triton at package import, so CPU-only services never load it.
"""
