"""Runtime: process groups, materialization, parallelisms and checkpoints under torchrun."""
