"""PopART's ai.graphcore tensor operators (filled in by the aiGraphcore work)."""
