"""Rank 1 ends at once; rank 0 fails 2 s later (a failure after another rank finished). No training."""

import os
import sys
import time

if os.environ.get("RANK") == "0":
    time.sleep(2.0)
    sys.exit("rank 0 failed after rank 1 had finished")
