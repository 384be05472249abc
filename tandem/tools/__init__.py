"""The commands beside the services: ``tandem bench``, ``tandem calibrate`` and ``tandem distill``.
Tools may import the services; the services and the shared core never import a tool."""
