"""PopART's aiGraphcore.lstm (filled in by the RNN work)."""
