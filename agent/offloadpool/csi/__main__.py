import sys

from offloadpool.csi.server import main

sys.exit(main())
