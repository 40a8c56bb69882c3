import sys

from offloadpool.dra.server import main

sys.exit(main())
