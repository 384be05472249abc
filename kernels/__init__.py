"""Kernels of the target's hot path.

Each op has a PyTorch reference in ``kernels/reference/<op>.py`` (runs anywhere, defines the
semantics) and, in a later issue, a Triton kernel in ``kernels/<op>.py`` with the same signature.
The target service uses Triton on CUDA and the reference elsewhere (``target_service.verifier``).
"""
