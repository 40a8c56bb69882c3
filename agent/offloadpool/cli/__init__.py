"""The ``offloadpool`` command: provision, inspect and release pools on this machine, run the
demo (the README's main job) and the benchmarks. Needs the ``agent`` extra (rich, PyYAML,
pydantic)."""
