"""Benchmarks (``offloadpool bench ...``): strategies side by side in one run, medians and
spread, each case warmed untimed right before its timed run, cases interleaved. The scripts in
the repository's ``bench/`` folder are thin entry points to these modules."""
