"""Generated gRPC stubs for package tandem.v1 (python -m tandem.rpc.protogen)."""
