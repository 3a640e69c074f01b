import signal
import sys

if sys.argv[1:2] == ["--supervised"]:  # Ctrl-C reaches the whole process group: the supervisor answers it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
from runtime.coordinator.cli import main, supervised_main

sys.exit(supervised_main(sys.argv) if sys.argv[1:2] == ["--supervised"] else main())
