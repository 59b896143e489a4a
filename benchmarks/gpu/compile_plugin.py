"""pytest plugin of the GPU kit's tests step (`-p compile_plugin`, this folder on the path): at the end of the
session, the programs compiled and compile seconds of the whole test run (`dflash_jax.compilation`) as JSON into
the file `$KIT_COMPILE_FILE`."""

from __future__ import annotations

import json
import os

from dflash_jax.compilation import compile_counts  # imported with the plugin: its counters see every compile


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KIT_COMPILE_FILE")
    if path:
        with open(path, "w") as f:
            json.dump(compile_counts().as_dict(), f)
