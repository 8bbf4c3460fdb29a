"""`python -m sidecar` is the same as the `xsp-sidecar` command."""

from sidecar.cli import main

raise SystemExit(main())
