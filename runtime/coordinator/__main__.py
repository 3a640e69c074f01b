import sys

from runtime.coordinator.core import main

sys.exit(main())
