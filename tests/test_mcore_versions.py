"""The compatibility registry's record of the megatron-core releases each entry was written
against (``Patch.written_against`` in parallel/mcore_compat.py) and its report for a release
the entries were never checked on (what GPU images carry: 0.17-0.19)."""

from __future__ import annotations

import re

from parallel import mcore_compat


def test_every_entry_names_the_releases_it_was_written_against():
    for patch in mcore_compat.PATCHES:
        assert patch.written_against, patch.target
        for release in patch.written_against:
            assert re.fullmatch(r"\d+\.\d+\.\d+", release), (patch.target, release)


def test_the_installed_release_is_one_every_entry_was_written_against():
    installed = mcore_compat.megatron_core_version()
    assert mcore_compat.entries_not_written_for(installed) == []
    assert mcore_compat.version_report() == []


def test_another_release_lists_every_entry_with_its_staleness_check():
    report = mcore_compat.version_report("0.19.2")
    assert len(report) == len(mcore_compat.PATCHES)
    for line, patch in zip(report, mcore_compat.PATCHES):
        assert line.startswith(f"{patch.target} ({patch.kind}): written against 0.16.1, "
                               "megatron-core 0.19.2 here: ")
        # Checked against what is installed here (0.16.1), where every check passes.
        assert line.endswith("staleness check passes"), line
