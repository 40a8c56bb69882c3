"""offloadpool: CPU KV-cache offload memory provisioned by the node, attached by the engine.

The package has two source roots (``agent/`` and ``operator/``) in the repository; in a
development checkout ``pkgutil.extend_path`` joins them so ``offloadpool.operator`` resolves
from ``operator/offloadpool/operator``. In a wheel both live in one folder.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.2-dev"
