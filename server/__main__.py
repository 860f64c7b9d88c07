import sys

from server.cli import main

if __name__ == "__main__":  # guarded: the spawned engine process re-imports the main module
    sys.exit(main())
