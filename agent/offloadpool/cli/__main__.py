from offloadpool.cli.main import main

raise SystemExit(main())
