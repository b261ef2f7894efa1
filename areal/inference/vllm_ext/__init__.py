"""areal's vLLM worker extension (``--worker-extension-cls``).

The extension module (``areal_vllm_worker_ext.py`` in this folder) is imported by vLLM's
worker processes, possibly under another interpreter (a separate vLLM venv). It imports
only vLLM and torch, never the ``areal`` package: the server command puts this folder
on ``PYTHONPATH`` and names the class by its top-level module.
"""

import os

EXTENSION_DIR = os.path.dirname(os.path.abspath(__file__))
WORKER_EXTENSION_CLS = "areal_vllm_worker_ext.ArealWorkerExtension"
