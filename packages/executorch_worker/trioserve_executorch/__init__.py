"""trioserve's ExecuTorch worker, packaged on its own (docs/executorch.md, Install).

The package holds one executable, ``bin/trioserve-executorch-worker``; trioserve locates it
without importing this module (``importlib.util.find_spec``), so this file only documents it.
"""

from pathlib import Path

WORKER = Path(__file__).parent / "bin" / "trioserve-executorch-worker"
