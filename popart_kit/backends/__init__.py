"""Session backends: ``popart_sdk`` (Graphcore's Poplar SDK, imported lazily) and ``xla``."""
