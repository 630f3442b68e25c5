import sys

from primus_v4.cli import main

sys.exit(main())
