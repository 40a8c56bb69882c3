#!/usr/bin/env python3
"""Thin entry point: ``python bench/startup.py [--capacity 2Gi] [--json] ...`` is
``offloadpool bench startup ...`` (implementation: offloadpool.bench.startup)."""

import sys

from offloadpool.bench.startup import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
