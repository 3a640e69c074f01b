import sys

from runtime.coordinator.core import main, supervised_main

sys.exit(supervised_main(sys.argv) if sys.argv[1:2] == ["--supervised"] else main())
