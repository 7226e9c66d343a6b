from pathlib import Path

import pytest

from pagoda import paths


def test_cache_root_is_pagoda_cache_dir_else_xdg_else_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "p"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert paths.cache_root() == tmp_path / "p"
    monkeypatch.delenv("PAGODA_CACHE_DIR")
    assert paths.cache_root() == tmp_path / "x" / "pagoda"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert paths.cache_root() == tmp_path / "h" / ".cache" / "pagoda"


def test_every_cache_folder_is_under_the_one_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    for folder in (paths.kernel_builds_dir(), paths.tokenizers_dir(), paths.models_dir(), paths.hf_copies_dir(),
                   paths.peers_dir()):
        assert folder.parent == tmp_path


def test_tuning_cache_names_the_tuning_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(paths.TUNING_CACHE_ENV, raising=False)
    assert paths.tuning_file_override() is None
    monkeypatch.setenv(paths.TUNING_CACHE_ENV, str(tmp_path / "t.json"))
    assert paths.tuning_file_override() == tmp_path / "t.json"


def test_paths_and_build_spec_import_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; import pagoda.paths, pagoda.kernels.build_spec; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
