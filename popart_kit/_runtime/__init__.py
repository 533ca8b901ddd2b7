"""Sessions and the backends that run them: Graphcore's Poplar SDK (``popart_sdk``, imported
lazily) and the embedded JAX/XLA runtime (``xla``), found through the registry in ``backend``."""
