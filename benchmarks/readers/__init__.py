"""One reader per experiment: each prints the tables of any of its runs under ``benchmarks/results/EXPERIMENT/``."""
