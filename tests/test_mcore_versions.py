"""The compatibility registry's record of the megatron-core releases each entry was written
against (``Patch.written_against`` in parallel/mcore_compat.py: 0.16.1 and 0.19.2), the entries a
release no longer needs, the other releases' fingerprints, and its report for a release the
entries were never checked on (0.17, 0.18)."""

from __future__ import annotations

import re
from dataclasses import replace

from parallel import mcore_compat


def test_every_entry_names_the_releases_it_was_written_against():
    for patch in mcore_compat.PATCHES:
        assert patch.written_against, patch.target
        for release in (*patch.written_against, *patch.not_needed_on,
                        *(fit[0] for fit in patch.other_fits)):
            assert re.fullmatch(r"\d+\.\d+\.\d+", release), (patch.target, release)
            assert release in patch.written_against, (patch.target, release)


def test_the_installed_release_is_one_every_entry_was_written_against():
    installed = mcore_compat.megatron_core_version()
    assert mcore_compat.entries_not_written_for(installed) == []
    assert mcore_compat.version_report() == []
    assert mcore_compat.stale_reasons() == []


def test_another_release_lists_every_entry_with_its_staleness_check():
    report = mcore_compat.version_report("0.18.0")
    assert len(report) == len(mcore_compat.PATCHES)
    installed = mcore_compat.megatron_core_version()
    for line, patch in zip(report, mcore_compat.PATCHES):
        assert line.startswith(f"{patch.target} ({patch.kind}): written against 0.16.1, 0.19.2, "
                               f"megatron-core 0.18.0 here: ")
        # Checked against what is installed here, where every check passes.
        assert line.endswith("staleness check passes"), (installed, line)


def test_entries_0_19_no_longer_needs_are_neither_applied_nor_checked():
    not_needed = {p.target for p in mcore_compat.PATCHES
                  if not mcore_compat.is_needed(p, "0.19.2")}
    assert not_needed == {"torch.cuda.default_stream",
                          "megatron.core.transformer.moe.moe_utils.te_general_gemm",
                          "torch.distributed.get_rank"}
    assert all(mcore_compat.is_needed(p, "0.16.1") for p in mcore_compat.PATCHES)
    lines = mcore_compat.not_needed_report("0.19.2")
    assert len(lines) == 3 and all(line.endswith("not needed on megatron-core 0.19.2")
                                   for line in lines)


def test_a_fingerprint_of_either_release_fits_and_a_third_does_not():
    zero2 = next(p for p in mcore_compat.OVERRIDES
                 if p.attr == "_copy_model_grads_to_main_grads")
    release, fingerprint, signature = zero2.other_fits[0]
    assert release == "0.19.2" and signature == "(self)"
    installed_fp = mcore_compat.fingerprint_of(
        mcore_compat.resolve_owner(zero2.module)._copy_model_grads_to_main_grads)
    # whichever release is installed, its fingerprint is one of the two
    assert installed_fp in {(zero2.fingerprint, zero2.signature), (fingerprint, signature)}
    only_other = replace(zero2, fingerprint="0" * 16,
                         other_fits=(("0.19.2", "1" * 16, "(self)"),))
    assert "changed" in mcore_compat.stale_reason(only_other)
