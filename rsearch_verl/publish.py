"""Publishing a directory built elsewhere: a build writes into a temporary directory beside its destination and
renames it into place, so a reader never sees half of it and processes building the same thing at once race
harmlessly. The bottom floor: imports nothing of the package.

    tmp = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(out))
    ... write everything into tmp ...
    publish_dir(tmp, out, marker="config.json")    # `marker`: the file whose presence means complete
"""

from __future__ import annotations

import os
import shutil


def publish_dir(tmp: str, root: str, marker: str) -> None:
    """Atomic rename of `tmp` into place at `root`; `marker` is the file whose presence means complete. A concurrent
    builder that won the race leaves an identical directory there, which is kept (and `tmp` removed)."""
    if os.path.exists(root) and not os.path.exists(os.path.join(root, marker)):
        shutil.rmtree(root, ignore_errors=True)  # a leftover from a build killed mid-rename
    try:
        os.rename(tmp, root)
    except OSError:
        if not os.path.exists(os.path.join(root, marker)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
