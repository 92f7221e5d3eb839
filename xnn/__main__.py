import sys

from xnn.cli.main import main

sys.exit(main())
