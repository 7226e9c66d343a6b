import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_imports.py"


def test_the_package_has_no_import_cycle_and_nothing_below_the_engine_imports_it() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
