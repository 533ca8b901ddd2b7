"""The foundation every layer stands on: problems and how they are reported, PopART's names,
pure arithmetic (pipeline depth, host array shapes, pipeline schedules), atomic files,
terminal text and the rule registry. Imports nothing of the kit but ``errors``."""
