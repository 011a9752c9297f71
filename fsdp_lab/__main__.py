"""``python -m fsdp_lab ...`` is the ``fsdp-lab`` command (for an environment whose scripts
folder is not on PATH)."""

import sys

from fsdp_lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
