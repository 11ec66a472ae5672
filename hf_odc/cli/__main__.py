"""``python -m hf_odc.cli``: the ``hf-odc`` command."""

import sys

from . import main

sys.exit(main())
