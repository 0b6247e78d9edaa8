from ramjet.cli import main

raise SystemExit(main())
