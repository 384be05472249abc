"""tandem: speculative decoding served as a pair of gRPC services plus an OpenAI-compatible gateway."""

__version__ = "0.1.0"
