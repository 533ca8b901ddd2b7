"""PopART's ai.graphcore network operators (filled in by the aiGraphcore work)."""
