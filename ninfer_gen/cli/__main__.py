import sys

from ninfer_gen.cli.main import main

sys.exit(main())
