"""Host data: the arrays PopART's StepIO reads and writes, per step, replica and instance."""
