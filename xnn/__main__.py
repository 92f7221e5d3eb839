import sys

from xnn.cli.main import drop_working_directory, main

drop_working_directory()  # as the `xnn` command: nothing is imported from the working directory
sys.exit(main())
