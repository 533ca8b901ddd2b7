"""LSTM, GRU and RNN (ai.onnx) and PopART's own LSTM (ai.graphcore) (filled in by the RNN work)."""
