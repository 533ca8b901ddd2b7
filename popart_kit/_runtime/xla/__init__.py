"""The reference runtime: ONNX lowered to JAX, run with PopART's semantics on CPU or GPU."""
