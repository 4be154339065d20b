"""Test helpers: multi-rank pools of gloo workers and parity harnesses."""
