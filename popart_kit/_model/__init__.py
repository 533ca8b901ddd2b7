"""ONNX models: the PopART-compatible Builder, loading, pipeline layout and its rules, and the
graph and index checks a model passes before it runs."""
