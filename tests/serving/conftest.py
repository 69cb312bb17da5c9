"""Lets the serving tests import their stand-in server (``fake_vllm``) by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
