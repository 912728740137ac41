from dpcompare.cli import main

raise SystemExit(main())
