"""The helper goes into inference images: importing it must load nothing but the stdlib."""

from __future__ import annotations

import json

from fixtures.pinning_pools import run_python

FORBIDDEN = ("kopf", "kubernetes", "pydantic", "yaml", "rich", "prometheus_client", "torch", "cuda")

CHILD = """
import json, sys
import offloadpool.pinning
from offloadpool.pinning import attach, plan_pin_ranges, PinStats
import offloadpool.pinning.backends
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_import_loads_no_heavy_or_optional_dependency() -> None:
    top_level = set(json.loads(run_python(CHILD).stdout))
    assert "offloadpool" in top_level
    loaded = sorted(top_level & set(FORBIDDEN))
    assert loaded == [], f"importing offloadpool.pinning loaded {loaded}"


def test_mlock_backend_needs_no_optional_dependency() -> None:
    code = """
    import json, sys
    from offloadpool.pinning import get_backend
    print(json.dumps([get_backend("mlock").name, sorted({m.split(".")[0] for m in sys.modules})]))
    """
    name, mods = json.loads(run_python(code).stdout)
    assert name == "mlock"
    assert not set(mods) & set(FORBIDDEN)
