"""The compiler: trace, annotate, propagate, redistribute, localize; one pass per file (see compile.py)."""
