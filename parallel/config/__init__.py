"""Each technique's config keys and the rules that check them, one module per technique.

``parallel.layout.ParallelConfig`` and the job's ``TrainConfig`` are composed of these
``*Options`` dataclasses, so every key stays flat (``parallel.pipeline_zero2``,
``train.muon_momentum``); ``validate_layout`` and ``TrainConfig.validate`` call the ``check_*``
rules. Nothing here imports megatron-core (only the standard library and light ``parallel``
modules): the launchers check a config in about a second, before any rank imports it
(tests/test_slurm.py holds the slurm batch step to that).
"""
