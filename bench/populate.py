#!/usr/bin/env python3
"""Thin entry point: ``python bench/populate.py [--capacity 4Gi] [--json] ...`` is
``offloadpool bench populate ...`` (implementation: offloadpool.bench.populate)."""

import sys

from offloadpool.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "populate", *sys.argv[1:]]))
