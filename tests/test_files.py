"""Writes that readers never see half of, and that leave nothing behind where they fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.files import atomic_write_text


def test_a_write_replaces_the_file_whole_and_makes_its_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "record.json"
    atomic_write_text(path, "first")
    atomic_write_text(path, "second é")
    assert path.read_text(encoding="utf-8") == "second é"
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]  # no temporary file left


def test_a_folder_that_cannot_be_made_raises_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file where the folder would be")
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "taken" / "record.json", "text")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]
