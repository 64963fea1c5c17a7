from activator.cli import main

raise SystemExit(main())
