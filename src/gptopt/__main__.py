"""python -m gptopt ... (also what torchrun runs: torchrun --nproc_per_node N -m gptopt train ...)"""

import sys

from gptopt.cli import main

sys.exit(main())
