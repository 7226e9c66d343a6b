"""The settings that must be in the environment before torch starts: set by importing pagoda, a user's own kept."""
from __future__ import annotations

import os
import subprocess
import sys

from pagoda.process_env import DEFAULTS

_SHOW = ("import os, pagoda, pagoda.process_env\n"
         "print(' '.join(os.environ[k] for k in sorted(pagoda.process_env.DEFAULTS)))")


def _show(env: dict[str, str]) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in DEFAULTS}
    out = subprocess.run([sys.executable, "-c", _SHOW], env={**base, **env}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_importing_pagoda_sets_the_defaults_and_keeps_the_users() -> None:
    names = sorted(DEFAULTS)
    assert _show({}) == [DEFAULTS[k] for k in names]
    mine = {"GOMP_SPINCOUNT": "123", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert _show(mine) == [mine[k] for k in names]
