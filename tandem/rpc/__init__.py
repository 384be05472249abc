"""gRPC plumbing the services share: servers and channels with one set of options (``endpoints``),
the health probe a container runs (``healthcheck``), token-tree helpers both ends of Verify use
(``token_tree``), and the stub generator (``protogen``). The stubs themselves are ``tandem.v1``."""
